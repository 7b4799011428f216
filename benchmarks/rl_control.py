"""RL rollout control latencies on the embedded model (SmolLM2-135M-Instruct GGUF, dense weights):
weight updates from disk, sleep / wake up, and the pause -> update -> resume round trip of a server.

Offline (``LLM`` in process, ``--num-threads`` threads):
- ``update_weights_from_disk`` from a safetensors directory (the engine's own weights written out
  under their checkpoint names, so the update is a real full copy) and from the GGUF file itself;
  each split into reading + checking the checkpoint (``read_checkpoint``) and the rest (copy into
  the parameters, prefix-cache flush); with ``--kv-offload-disk`` also moving the disk tier to the
  new fingerprint (one sha256 pass over the weights);
- the model fingerprint alone (``weight_info`` on fresh weights);
- ``sleep`` / ``wake_up`` at level 1 (KV pool freed and zeroed again) and level 2 (weights freed and
  read back from the last checkpoint path).

Server (``tokenmill serve --enable-rl-endpoints``, unless ``--skip-server``): while ``--streams``
streaming requests decode, ``POST /pause_generation {"mode": "wait"}`` -> ``/update_weights_from_disk``
(the safetensors directory) -> ``/resume_generation``; reported per call and in total, and the
time from resume to the first token of a request held while paused. The pause waits for the
streams in flight, so it includes their remaining decode time; ``abort`` mode is timed too.

Each timing is the median (and min) of ``--repeats`` runs. Numbers vary on shared machines;
record quiet-machine numbers in benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/rl_control.py [--repeats 3] [--num-threads 2] [--skip-server]
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.models.default_model import default_model_path
from tokenmill.rl.checkpoint import read_checkpoint

REPO = Path(__file__).resolve().parents[1]


def dense_kwargs() -> dict:
    """``quantization="none"`` where the engine has that option (GGUF weights may otherwise stay quantized)."""
    return {"quantization": "none"} if "quantization" in inspect.signature(LLM).parameters else {}


def export_safetensors(llm: LLM, out_dir: Path) -> Path:
    """Write the engine's weights as a Hugging Face directory (config.json + model.safetensors, checkpoint
    names: fused qkv / gate_up split back into their projections)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = llm.engine.loaded
    loaded.hf_config.save_pretrained(out_dir)
    params = dict(loaded.model.named_parameters())
    tensors = {}
    for name, target in llm.engine.rl_state.targets.items():
        param = params[target.param_name]
        tensors[name] = (param if target.start is None else param.narrow(0, target.start, target.size)).detach().clone()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def timed(fn, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds)}


def offline(args, ckpt_dir: Path) -> dict:
    kwargs = dict(num_threads=args.num_threads, kv_cache_memory=0.25, **dense_kwargs())
    if args.kv_offload_disk:
        kwargs.update(kv_offload_memory=0.05, kv_offload_disk_path=str(ckpt_dir / "kv"))
    with LLM(**kwargs) as llm:
        export_safetensors(llm, ckpt_dir / "hf")
        greedy = SamplingParams(temperature=0, max_tokens=16)
        prompt = "The capital of France is"
        reference = llm.generate([prompt], greedy)[0].outputs[0].text
        engine = llm.engine
        gguf = str(default_model_path())
        out = {
            "read_safetensors": timed(lambda: read_checkpoint(str(ckpt_dir / "hf"), engine.loaded.hf_config,
                                                              engine.rl_state.targets), args.repeats),
            "update_from_safetensors": timed(lambda: llm.update_weights_from_disk(str(ckpt_dir / "hf")), args.repeats),
            "read_gguf": timed(lambda: read_checkpoint(gguf, engine.loaded.hf_config, engine.rl_state.targets),
                               args.repeats),
            "update_from_gguf": timed(lambda: llm.update_weights_from_disk(gguf), args.repeats),
        }

        def fingerprint() -> None:
            engine.rl_state.fingerprint = None
            llm.weight_info()

        out["fingerprint"] = timed(fingerprint, args.repeats)
        llm.update_weights_from_disk(str(ckpt_dir / "hf"))  # level 2 reads back from this path
        for level in (1, 2):
            sleeps, wakes = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.sleep(level)
                sleeps.append(time.perf_counter() - start)
                start = time.perf_counter()
                llm.wake_up()
                wakes.append(time.perf_counter() - start)
            out[f"sleep_level{level}"] = {"median_s": statistics.median(sleeps), "min_s": min(sleeps)}
            out[f"wake_up_level{level}"] = {"median_s": statistics.median(wakes), "min_s": min(wakes)}
        assert llm.generate([prompt], greedy)[0].outputs[0].text == reference, "outputs changed after wake-up"
        out["num_parameters"] = sum(p.numel() for p in engine.loaded.model.parameters())
        out["dtype"] = str(engine.loaded.dtype)
        out["kv_pool_mib"] = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() / 2**20
    return out


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> None:
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            pass


async def _server_rounds(url: str, ckpt: Path, args) -> dict:
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    async with httpx.AsyncClient(timeout=600) as client:
        for mode in ("wait", "abort"):
            for _ in range(args.repeats):
                streams = [asyncio.ensure_future(_stream(client, url, args.stream_tokens)) for _ in range(args.streams)]
                await asyncio.sleep(0.5)  # the streams are decoding
                start = time.perf_counter()
                response = await client.post(f"{url}/pause_generation", json={"mode": mode})
                response.raise_for_status()
                paused = time.perf_counter()
                held = asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 1, "temperature": 0}))
                response = await client.post(f"{url}/update_weights_from_disk", json={"model_path": str(ckpt)})
                response.raise_for_status()
                updated = time.perf_counter()
                (await client.post(f"{url}/resume_generation", json={})).raise_for_status()
                resumed = time.perf_counter()
                (await held).raise_for_status()
                record(f"{mode}:pause", paused - start)
                record(f"{mode}:update", updated - paused)
                record(f"{mode}:resume", resumed - updated)
                record(f"{mode}:round_trip", resumed - start)
                record(f"{mode}:held_request_done_after_resume", time.perf_counter() - resumed)
                await asyncio.gather(*streams)
    return {k: {"median_s": statistics.median(v), "min_s": min(v)} for k, v in results.items()}


def server(args, ckpt: Path) -> dict:
    port = args.port
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--port", str(port), "--enable-rl-endpoints",
           "--num-threads", str(args.num_threads), "--kv-cache-memory", "0.25", "--no-enable-log-requests"]
    if dense_kwargs():
        cmd += ["--quantization", "none"]
    log = open(ckpt.parent / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(ckpt.parent / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server not healthy")
            time.sleep(0.5)
        return asyncio.run(_server_rounds(url, ckpt, args))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--kv-offload-disk", action="store_true", help="with RAM and disk KV tiers (offline part)")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--streams", type=int, default=4, help="streams decoding when the server is paused")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl_control_") as tmp:
        tmp = Path(tmp)
        results = {"offline": offline(args, tmp)}
        print(json.dumps(results["offline"], indent=2))
        if not args.skip_server:
            results["server"] = server(args, tmp / "hf")
            print(json.dumps(results["server"], indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
