"""Batch-1 decode of the embedded model with and without a busy neighbour: tokenmill against transformers.

On a 2-core machine another process keeping one core busy hurts an engine whose every layer ends in
a parallel region: a thread that the OS deschedules stalls the barrier for a whole timeslice. This
script measures, in one run, each configuration quiet and then beside a one-core busy loop
(``python -c "while True: pass"``), each in a fresh process (OpenMP settings are read at start-up),
alternating the order and keeping the best of ``--repeats`` runs:

- tokenmill with ``--dtype auto`` (float32 on CPUs without bf16 arithmetic) and with the other dtype;
- tokenmill ``--dtype auto`` with ``--no-cpu-kernels``;
- tokenmill with other OpenMP wait settings (``--spin-variants``, e.g. GOMP_SPINCOUNT=0);
- transformers float32 on the same GGUF (``generate``, greedy), the peer of ../shared/baseline.md.

Decode tok/s = (new tokens - 1) / (time of a full generation - time of a 1-token generation), 64-token prompt.

    python benchmarks/cpu_contention.py --new-tokens 64 --repeats 2 --output-json contention.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = list(range(1000, 1064))


def child_tokenmill(dtype: str, new_tokens: int, cpu_kernels: bool) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_model_len=512, kv_cache_memory=0.1, cpu_kernels=cpu_kernels)
    prompt = {"prompt_token_ids": PROMPT}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt, full)  # warm-up (the prefix cache then serves the prompt in both timed calls)
    t0 = time.perf_counter()
    llm.generate(prompt, one)
    t1 = time.perf_counter()
    llm.generate(prompt, full)
    t2 = time.perf_counter()
    return {"tok_s": (new_tokens - 1) / ((t2 - t1) - (t1 - t0)), "dtype": str(llm.engine.loaded.dtype),
            "kernels": llm.engine.runner.kernel_choice}


def child_transformers(new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.models.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])

    def gen(n: int) -> None:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.inference_mode():
        gen(new_tokens)
        t0 = time.perf_counter()
        gen(1)
        t1 = time.perf_counter()
        gen(new_tokens)
        t2 = time.perf_counter()
    return {"tok_s": (new_tokens - 1) / ((t2 - t1) - (t1 - t0)), "dtype": "torch.float32", "kernels": "transformers"}


def run_child(config: dict, new_tokens: int) -> dict:
    env = {**os.environ, **config.get("env", {})}
    cmd = [sys.executable, __file__, "--child", json.dumps(config), "--new-tokens", str(new_tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{config['name']} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spin-variants", default="0", help="comma-separated GOMP_SPINCOUNT values to add ('' for none)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        config = json.loads(args.child)
        if config["engine"] == "transformers":
            result = child_transformers(args.new_tokens)
        else:
            result = child_tokenmill(config["dtype"], args.new_tokens, config.get("cpu_kernels", True))
        print(json.dumps(result))
        return

    from tokenmill.csrc_build import cpu_has_native_bf16

    auto, other = ("bfloat16", "float32") if cpu_has_native_bf16() else ("float32", "bfloat16")
    configs = [
        {"name": f"tokenmill auto ({auto})", "engine": "tokenmill", "dtype": "auto"},
        {"name": f"tokenmill {other}", "engine": "tokenmill", "dtype": other},
        {"name": "tokenmill auto --no-cpu-kernels", "engine": "tokenmill", "dtype": "auto", "cpu_kernels": False},
        {"name": "transformers fp32", "engine": "transformers"},
    ]
    for spin in filter(None, args.spin_variants.split(",")):
        configs.append({"name": f"tokenmill auto, GOMP_SPINCOUNT={spin}", "engine": "tokenmill", "dtype": "auto",
                        "env": {"GOMP_SPINCOUNT": spin}})
    best: dict[tuple[str, bool], dict] = {}
    for rep in range(args.repeats):
        for busy in ((False, True) if rep % 2 == 0 else (True, False)):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for config in (configs if rep % 2 == 0 else configs[::-1]):
                    result = run_child(config, args.new_tokens)
                    key = (config["name"], busy)
                    if key not in best or result["tok_s"] > best[key]["tok_s"]:
                        best[key] = result
                    print(f"  {config['name']:40s} busy={busy!s:5s} {result['tok_s']:7.1f} tok/s", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    peer = {busy: best[("transformers fp32", busy)]["tok_s"] for busy in (False, True)}
    print(f"\n{'configuration':40s} {'quiet tok/s':>12s} {'busy tok/s':>11s} {'busy/quiet':>10s} "
          f"{'vs tf quiet':>11s} {'vs tf busy':>10s}")
    rows = []
    for config in configs:
        quiet, busy = best[(config["name"], False)]["tok_s"], best[(config["name"], True)]["tok_s"]
        rows.append({"name": config["name"], "dtype": best[(config["name"], False)]["dtype"],
                     "kernels": best[(config["name"], False)]["kernels"], "quiet_tok_s": quiet, "busy_tok_s": busy})
        print(f"{config['name']:40s} {quiet:12.1f} {busy:11.1f} {busy / quiet:10.2f} "
              f"{quiet / peer[False]:11.2f} {busy / peer[True]:10.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
