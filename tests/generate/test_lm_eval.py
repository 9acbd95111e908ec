"""lm-eval-harness through the `forge` model class on local Shakespeare tasks, against the model's own forward.

One simple_evaluate call runs the three local tasks (tag forge_shakespeare) with a 64-token window, so contexts are
cut and long documents span several windows; each reported metric is recomputed here from unpadded forwards.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import lm_eval
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from forge.checkpoint.convert import load_pretrained, save_as
from forge.generate.lm_eval_adapter import ForgeLM, main
from forge.generate.lm_eval_tasks import GEN, NEXT_LINE, PPL, TAG, write_tasks
from forge.models.llama import TransformerArgs, build_transformer

DOCS = 8
WINDOW = 64
GEN_TOKENS = 10


@dataclass
class Setup:
    checkpoint: Path
    tokenizer_file: Path
    tasks: Path
    model: torch.nn.Module
    corpus: object

    def docs(self, task: str) -> list[dict]:
        return [json.loads(line) for line in (self.tasks / f"{task}.jsonl").read_text().splitlines()]

    def encode(self, text: str) -> list[int]:
        return self.corpus.tokenizer.encode(text).ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus) -> Setup:
    """A tiny model with the 8k BPE vocabulary, saved as a consolidated file, and the local tasks."""
    folder = tmp_path_factory.mktemp("lm_eval")
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=8192, max_seq_len=256)
    save_as("torch", build_transformer(args, seed=5).state_dict(), args, folder / "model.pt")
    tasks = write_tasks(folder / "tasks", count=DOCS)
    model = load_pretrained(folder / "model.pt")
    return Setup(folder / "model.pt", corpus.folder / "tokenizer.json", tasks, model, corpus)


@pytest.fixture(scope="module")
def evaluated(setup) -> dict:
    model_args = f"checkpoint={setup.checkpoint},tokenizer={setup.tokenizer_file},device=cpu,batch_size=3"
    return lm_eval.simple_evaluate(
        model="forge",
        model_args=f"{model_args},max_length={WINDOW}",
        tasks=[TAG],
        task_manager=TaskManager(include_path=str(setup.tasks), include_defaults=False),
        gen_kwargs={"max_gen_toks": GEN_TOKENS},
        bootstrap_iters=0,
        log_samples=True,
    )


def score(model, inputs: list[int], targets: list[int]) -> float:
    """Sum of log p(targets) at the last len(targets) positions of one unpadded forward over `inputs`."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs]))[0, -len(targets) :]
    return logits.log_softmax(-1).gather(-1, torch.tensor(targets)[:, None]).sum().item()


def pair_score(setup: Setup, context: str, continuation: str, window: int) -> float:
    """log p(continuation | context), the context cut from the left so that `window` tokens are fed."""
    ids_context, ids = setup.encode(context), setup.encode(context + continuation)
    assert ids[: len(ids_context)] == ids_context
    return score(setup.model, ids[:-1][-window:], ids[len(ids_context) :])


def rolling_reference(model, tokens: list[int], window: int, eos: int) -> float:
    """lm-eval's rolling log-likelihood written out: blocks of `window` predicted tokens; the first block follows
    EOS, each later one is predicted from the `window` tokens that end just before its last token."""
    first = tokens[:window]
    total = score(model, [eos] + first[:-1], first)
    start = window
    while start < len(tokens):
        end = min(start + window, len(tokens))
        total += score(model, tokens[end - 1 - window : end - 1], tokens[start:end])
        start = end
    return total


def greedy_by_recomputation(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Greedy tokens from a full forward over the unpadded sequence at every step, stopping before EOS."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([seq]))[0, -1].argmax())
            if token == eos:
                break
            seq.append(token)
    return seq[len(prompt) :]


def logged(evaluated: dict, task: str, doc: dict) -> dict:
    return next(sample for sample in evaluated["samples"][task] if sample["doc"] == doc)


def test_multiple_choice_acc_equals_argmax_of_hand_computed_loglikelihoods(setup, evaluated):
    acc = acc_norm = 0
    truncated = False
    for doc in setup.docs(NEXT_LINE):
        lls = [pair_score(setup, doc["context"], "\n" + choice, WINDOW) for choice in doc["choices"]]
        lengths = [len(choice) for choice in doc["choices"]]
        acc += max(range(4), key=lambda i: lls[i]) == doc["label"]
        acc_norm += max(range(4), key=lambda i: lls[i] / lengths[i]) == doc["label"]
        assert [r[0][0] for r in logged(evaluated, NEXT_LINE, doc)["resps"]] == pytest.approx(lls, rel=1e-4, abs=1e-4)
        truncated |= len(setup.encode(doc["context"])) > WINDOW
    assert truncated  # at least one context was cut to fit the window
    metrics = evaluated["results"][NEXT_LINE]
    assert metrics["acc,none"] == pytest.approx(acc / DOCS)
    assert metrics["acc_norm,none"] == pytest.approx(acc_norm / DOCS)


def test_rolling_perplexities_equal_hand_computed_windows(setup, evaluated):
    total_ll = words = nbytes = 0
    spans = []
    for doc in setup.docs(PPL):
        tokens = setup.encode(doc["text"])
        spans.append(math.ceil(len(tokens) / WINDOW))
        total_ll += rolling_reference(setup.model, tokens, WINDOW, setup.corpus.eos_id)
        words += len(re.split(r"\s+", doc["text"]))
        nbytes += len(doc["text"].encode())
    assert max(spans) >= 3 and min(spans) == 1
    metrics = evaluated["results"][PPL]
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / words), rel=1e-4)
    assert metrics["byte_perplexity,none"] == pytest.approx(math.exp(-total_ll / nbytes), rel=1e-4)
    assert metrics["bits_per_byte,none"] == pytest.approx(-total_ll / nbytes / math.log(2), rel=1e-4)


def test_generate_until_equals_greedy_recomputation_cut_at_the_stop_string(setup, evaluated):
    matches = 0
    for doc in setup.docs(GEN):
        tokens = greedy_by_recomputation(
            setup.model, setup.encode(doc["context"] + "\n"), GEN_TOKENS, setup.corpus.eos_id
        )
        text = setup.corpus.tokenizer.decode(tokens).split("\n")[0]
        assert logged(evaluated, GEN, doc)["resps"] == [[text]]
        matches += text == doc["target"]
    assert evaluated["results"][GEN]["exact_match,none"] == pytest.approx(matches / DOCS)


def test_rolling_within_one_window_is_the_full_sequence_loss(setup):
    lm = ForgeLM(str(setup.checkpoint), device="cpu", tokenizer=str(setup.tokenizer_file), batch_size=2)
    texts = [doc["text"] for doc in setup.docs(PPL)]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for text, ll in zip(texts, got):
        tokens = torch.tensor([[setup.corpus.eos_id, *setup.encode(text)]])
        assert tokens.shape[1] <= 257
        with torch.no_grad():
            loss = F.cross_entropy(setup.model(tokens[:, :-1])[0], tokens[0, 1:], reduction="sum")
        assert ll == pytest.approx(-loss.item(), rel=1e-5)


def test_loglikelihood_is_the_sum_of_log_softmax_and_greedy_is_argmax(setup):
    lm = ForgeLM(str(setup.checkpoint), device="cpu", tokenizer=str(setup.tokenizer_file), batch_size=2, max_length=12)
    model, context = setup.model, "ROMEO\nBut, soft! what light through yonder window breaks?"
    ids = setup.encode(context)
    with torch.no_grad():
        greedy = [int(model(torch.tensor([ids[-12:]]))[0, -1].argmax())]
    greedy_text = setup.corpus.tokenizer.decode(greedy)
    requests = [(context, " It is the east"), ("", "JULIET\nAy me!"), (context, greedy_text)]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])

    # by hand: the context keeps its last tokens so that 12 are fed
    continuation = setup.encode(context + " It is the east")[len(ids) :]
    with torch.no_grad():
        logits = model(torch.tensor([(ids + continuation)[-13:-1]]))[0, -len(continuation) :]
    logp = logits.log_softmax(-1)
    assert got[0][0] == pytest.approx(sum(logp[i, t].item() for i, t in enumerate(continuation)), rel=1e-5)
    assert got[0][1] == (logp.argmax(-1).tolist() == continuation)
    # an empty context is scored after EOS
    juliet = setup.encode("JULIET\nAy me!")
    assert got[1][0] == pytest.approx(score(model, [setup.corpus.eos_id, *juliet[:-1]], juliet), rel=1e-5)
    # the model's own next token is greedy
    assert setup.encode(context + greedy_text)[len(ids) :] == greedy
    assert got[2] == (pytest.approx(score(model, ids[-12:], greedy), rel=1e-5), True)
    with pytest.raises(ValueError, match="max_seq_len=256"):
        ForgeLM(str(setup.checkpoint), device="cpu", tokenizer=str(setup.tokenizer_file), max_length=257)


def test_cli_missing_checkpoint_fails_with_a_message(setup, tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main([f"checkpoint={missing}", f"tokenizer={setup.tokenizer_file}", f"tasks=[{NEXT_LINE}]"]) == 1
    assert str(missing) in capsys.readouterr().err


def test_cli_writes_the_local_tasks_and_reports_the_same_accuracy(setup, evaluated, tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = [f"checkpoint={setup.checkpoint}", f"tokenizer={setup.tokenizer_file}", "device=cpu", f"max_length={WINDOW}"]
    assert main([*argv, f"tasks=[{NEXT_LINE}]", f"task_docs={DOCS}", f"output={out}"]) == 0
    printed = json.loads(capsys.readouterr().out)[NEXT_LINE]
    assert json.loads(out.read_text())["results"][NEXT_LINE]["acc,none"] == printed["acc,none"]
    assert printed["acc,none"] == evaluated["results"][NEXT_LINE]["acc,none"]
