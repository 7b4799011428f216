"""lm-evaluation-harness against a real `tokenmill serve` (tiny random Llama, float32), fully offline.

lm-eval's `local-completions` model finds /tokenizer_info and /tokenize on its own (remote tokenizer, no hub
download) and runs the two example tasks of examples/lm_eval/ plus a copy of the generation task whose targets
are, for half the items, the model's own greedy answers (so exact match is not trivially 0 on random weights).
References are computed in this process with `transformers` on the same weights: every choice's
log-likelihood and greedy flag, hence the multiple-choice accuracy (identical), and the greedy continuations,
hence both exact-match scores (identical). The loglikelihood request shape itself (echo, logprobs,
max_tokens 1, token-id prompts, several prompts in one request) is checked over plain HTTP.
"""
from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
import sys

import jinja2
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server_fixtures import REPO, ServerProcess
from tests.tiny_models import make_tiny_model

pytest.importorskip("lm_eval", reason="lm-eval is not installed (requirements.lock pins lm-eval[api])")

TASKS_DIR = REPO / "examples" / "lm_eval" / "tasks"
MAX_LENGTH = 512  # the tiny model's max_position_embeddings
GEN_MAX_TOKENS = 16  # tokenmill_gen.yaml's max_gen_toks


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def server_process(tiny_path, tmp_path_factory):
    """The server, started but maybe still loading (lm-eval imports meanwhile)."""
    args = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1", "--disable-log-requests"]
    proc = ServerProcess(tiny_path, args, tmp_path_factory.mktemp("logs") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def server(server_process):
    return server_process.wait_healthy()


# lm-eval's CLI in a subprocess; its slow imports (torch, transformers, datasets) overlap the server's loading,
# then it waits for /health before lm-eval starts (argv: server URL, then lm-eval's arguments).
LM_EVAL_MAIN = """
import sys, time, urllib.request
import lm_eval.evaluator, lm_eval.models.openai_completions
from lm_eval.__main__ import cli_evaluate
deadline = time.monotonic() + 300
while True:
    try:
        if urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the server never became healthy")
    time.sleep(0.2)
sys.argv = ["lm_eval", *sys.argv[2:]]
cli_evaluate()
"""


@pytest.fixture(scope="module")
def hf(tiny_path):
    """transformers' model and tokenizer on the same weights (one torch thread while this module runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(tiny_path)
    torch.set_num_threads(threads)


def token_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For j >= 1: log p(ids[j] | ids[:j]), the argmax token and its log-probability. Each (len(ids) - 1,)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (len, vocab)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    best, argmax = logp.max(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], argmax, best


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids: trailing spaces move to the
    continuation, the whole string is encoded once and cut at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def greedy_answer(model, tokenizer, prompt: str) -> str:
    """The continuation lm-eval asks for: greedy, up to 16 tokens or EOS, text cut at the first newline."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GEN_MAX_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new).split("\n")[0]


def exact(prediction: str, target: str) -> bool:
    """The task's exact match: spaces stripped, case and punctuation ignored."""
    table = str.maketrans("", "", string.punctuation)
    return prediction.strip().lower().translate(table) == target.lower().translate(table)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def lm_eval_run(server_process, tiny_path, hf, tmp_path_factory):
    """Run lm-eval once on tokenmill_mc, tokenmill_gen and tokenmill_gen_self; returns (results, samples, self docs)."""
    model, tokenizer = hf
    tasks = tmp_path_factory.mktemp("tasks")
    for name in ("tokenmill_mc.yaml", "tokenmill_gen.yaml"):
        shutil.copy(TASKS_DIR / name, tasks / name)  # the examples as shipped (data paths relative to the repo)
    docs = read_jsonl(TASKS_DIR / "tokenmill_gen.jsonl")
    template = jinja2.Template(yaml.safe_load((TASKS_DIR / "tokenmill_gen.yaml").read_text())["doc_to_text"])
    own = [greedy_answer(model, tokenizer, template.render(**d)).strip() for d in docs[:4]]
    self_docs = [{"question": d["question"], "answer": a} for d, a in zip(docs, own)] + docs[4:]
    (tasks / "self.jsonl").write_text("".join(json.dumps(d) + "\n" for d in self_docs))
    (tasks / "tokenmill_gen_self.yaml").write_text(
        f"include: tokenmill_gen.yaml\ntask: tokenmill_gen_self\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tasks / 'self.jsonl'}\n")
    out = tmp_path_factory.mktemp("lm_eval_out")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_datasets"))}
    url = server_process.url
    # tokenizer_backend=remote: lm-eval's default ("auto") probes the same endpoints with a 5 s timeout, too
    # short for a loaded CI box; test_remote_tokenizer_is_auto_detected runs that probe itself
    model_args = f"model={tiny_path},base_url={url}/v1/completions,num_concurrent=1,max_retries=3," \
                 f"max_length={MAX_LENGTH},tokenizer_backend=remote"
    cmd = [sys.executable, "-c", LM_EVAL_MAIN, url, "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "tokenmill_mc,tokenmill_gen,tokenmill_gen_self", "--include_path", str(tasks),
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:] + server_process.log()[-2000:]
    assert "Using remote tokenizer" in proc.stderr  # /tokenizer_info + /tokenize, no hub
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {task: sorted(read_jsonl(next(out.rglob(f"samples_{task}_*.jsonl"))), key=lambda s: s["doc_id"])
               for task in ("tokenmill_mc", "tokenmill_gen", "tokenmill_gen_self")}
    return results, samples, self_docs


def test_multiple_choice_accuracy_equals_transformers(lm_eval_run, hf):
    results, samples, _ = lm_eval_run
    model, tokenizer = hf
    docs = read_jsonl(TASKS_DIR / "tokenmill_mc.jsonl")
    assert [s["doc"] for s in samples["tokenmill_mc"]] == docs
    correct = 0
    for doc, sample in zip(docs, samples["tokenmill_mc"]):
        lls = []
        for choice, resp in zip(doc["choices"], sample["resps"]):
            context, continuation = encode_pair(tokenizer, f"Question: {doc['question']}\nAnswer:", f" {choice}")
            ids = context + continuation
            logp, argmax, _ = token_logprobs(model, ids)
            want = logp[len(context) - 1:].double().sum().item()
            greedy = bool((argmax[len(context) - 1:] == torch.tensor(continuation)).all())
            got, got_greedy = float(resp[0][0]), resp[0][1] == "True"
            assert got == pytest.approx(want, abs=2e-4), (doc["question"], choice)
            assert got_greedy == greedy
            lls.append(want)
        correct += max(range(len(lls)), key=lls.__getitem__) == doc["answer"]
    assert results["tokenmill_mc"]["acc,none"] == correct / len(docs)


@pytest.mark.parametrize("task", ["tokenmill_gen", "tokenmill_gen_self"])
def test_generation_exact_match_equals_a_direct_check(lm_eval_run, hf, task):
    results, samples, self_docs = lm_eval_run
    model, tokenizer = hf
    docs = read_jsonl(TASKS_DIR / "tokenmill_gen.jsonl") if task == "tokenmill_gen" else self_docs
    matches = 0
    for doc, sample in zip(docs, samples[task], strict=True):
        output = sample["resps"][0][0]
        assert output == greedy_answer(model, tokenizer, sample["arguments"]["gen_args_0"]["arg_0"])
        matches += exact(output, doc["answer"])
    assert results[task]["exact_match,strip"] == matches / len(docs)
    if task == "tokenmill_gen_self":
        assert matches >= 4  # the first four targets are the model's own greedy answers


def test_loglikelihood_request_shape_scores_correctly(server, tiny_path, hf):
    """What lm-eval sends for a loglikelihood: token-id prompts (two in one request), echo, logprobs 1,
    max_tokens 1, temperature 0. Every prompt token but the first gets its log-probability under the model,
    the best of its top alternatives is the argmax's (lm-eval's is_greedy test), and one greedy token follows."""
    model, tokenizer = hf
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ("Question: 2+2?\nAnswer: 4",
                                                                        "The quick brown fox jumps")]
    body = server.post("/v1/completions", {"model": tiny_path, "prompt": prompts, "echo": True, "logprobs": 1,
                                           "max_tokens": 1, "temperature": 0, "seed": 1234,
                                           "return_token_ids": True}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, choice in zip(prompts, body["choices"]):
        logp, _, best = token_logprobs(model, ids)
        lp = choice["logprobs"]
        assert choice["prompt_token_ids"] == ids
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(logp.tolist(), abs=2e-4)
        assert [max(top.values()) for top in lp["top_logprobs"][1:len(ids)]] == pytest.approx(best.tolist(), abs=2e-4)
        with torch.no_grad():
            next_id = model(torch.tensor([ids])).logits[0, -1].argmax().item()
        assert choice["token_ids"] == [next_id] and choice["finish_reason"] == "length"


def test_tokenizer_info_matches_the_tokenizer_and_template(server, hf):
    """/tokenizer_info's special tokens are the tokenizer's, and its chat template rendered the way lm-eval's
    remote tokenizer does (plain jinja2) gives the text of /tokenize with messages."""
    _, tokenizer = hf
    info = server.get_json("/tokenizer_info")
    for name in ("eos", "bos", "pad"):
        assert info[f"{name}_token"] == getattr(tokenizer, f"{name}_token")
        assert info[f"{name}_token_id"] == getattr(tokenizer, f"{name}_token_id")
    assert info["model_max_length"] == MAX_LENGTH and info["vocab_size"] == len(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                          add_generation_prompt=True)
    served = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert tokenizer.encode(text, add_special_tokens=False) == served
    eos_ids = server.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos_ids == [info["eos_token_id"]]  # how lm-eval's remote tokenizer finds the EOS id


def test_remote_tokenizer_is_auto_detected(server):
    """lm-eval's own probe (what ``tokenizer_backend=auto`` runs) finds /tokenizer_info and /tokenize."""
    from lm_eval.utils import check_remote_tokenizer_support

    assert check_remote_tokenizer_support(f"{server.url}/v1/completions", timeout=60)
