"""Small lm-eval-harness tasks built from the held-out scenes of the embedded Shakespeare corpus.

`write_tasks(folder)` writes jsonl documents and one task YAML per task into `folder`; pass the folder to
`lm_eval.tasks.TaskManager(include_path=folder)`. Nothing is downloaded: the YAMLs load the files through the
`json` builder of `datasets`. A "speech" is a paragraph of a scene whose first line names the speaker, e.g.
"ADAM\\nDear master, I can go no further...". The tasks, all tagged `forge_shakespeare`:

- forge_shakespeare_next_line (multiple_choice, acc / acc_norm): the speaker and the first lines of a speech, then
  which of four lines comes next (the true one, three from other speeches).
- forge_shakespeare_ppl (loglikelihood_rolling, word/byte perplexity, bits per byte): whole speeches.
- forge_shakespeare_gen (generate_until, exact_match): the speaker and first line; generate the second line.
"""

import json
import random
from pathlib import Path

import yaml

from forge.data.embedded import read_scenes

TAG = "forge_shakespeare"
NEXT_LINE, PPL, GEN = "forge_shakespeare_next_line", "forge_shakespeare_ppl", "forge_shakespeare_gen"
TASKS = (NEXT_LINE, PPL, GEN)


def held_out_speeches(val_every: int = 20) -> list[list[str]]:
    """Speeches of the validation scenes (as EmbeddedCorpus splits them), as lists of lines, speaker first."""
    scenes = [s for i, s in enumerate(read_scenes()) if (i + 1) % val_every == 0]
    paragraphs = [p.strip().split("\n") for scene in scenes for p in scene.split("\n\n") if p.strip()]
    return [p for p in paragraphs if len(p) >= 3 and p[0].isupper()]


def next_line_docs(speeches: list[list[str]], count: int, seed: int = 0, choices: int = 4) -> list[dict]:
    """{context, choices, label}: a speech cut after a random line, the true next line and distractors."""
    rng = random.Random(seed)
    lines = sorted({line for speech in speeches for line in speech[1:]})
    docs = []
    for speech in rng.sample(speeches, min(count, len(speeches))):
        cut = rng.randrange(2, len(speech))
        target = speech[cut]
        options = rng.sample([line for line in lines if line != target], choices - 1)
        label = rng.randrange(choices)
        options.insert(label, target)
        docs.append({"context": "\n".join(speech[:cut]), "choices": options, "label": label})
    return docs


def ppl_docs(speeches: list[list[str]], count: int) -> list[dict]:
    """{text}: the first `count` speeches as documents."""
    return [{"text": "\n".join(speech)} for speech in speeches[:count]]


def gen_docs(speeches: list[list[str]], count: int) -> list[dict]:
    """{context, target}: speaker and first line; the second line is the target."""
    return [{"context": "\n".join(speech[:2]), "target": speech[2]} for speech in speeches[:count]]


def _task(name: str, data: Path, **fields) -> dict:
    return {
        "task": name,
        "tag": [TAG],
        "dataset_path": "json",
        # the datasets cache stays next to the files rather than in ~/.cache/huggingface
        "dataset_kwargs": {"data_files": {"validation": str(data)}, "cache_dir": str(data.parent / "cache")},
        "validation_split": "validation",
        **fields,
        "metadata": {"version": 1.0},
    }


def task_configs(folder: Path) -> dict[str, dict]:
    """The task YAML contents, by task name, reading `<folder>/<task>.jsonl`."""
    return {
        NEXT_LINE: _task(
            NEXT_LINE,
            folder / f"{NEXT_LINE}.jsonl",
            output_type="multiple_choice",
            doc_to_text="{{context}}",
            target_delimiter="\n",
            doc_to_choice="choices",
            doc_to_target="label",
            metric_list=[
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
        ),
        PPL: _task(
            PPL,
            folder / f"{PPL}.jsonl",
            output_type="loglikelihood_rolling",
            doc_to_text="",
            doc_to_target="{{text}}",
            metric_list=[
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ],
        ),
        GEN: _task(
            GEN,
            folder / f"{GEN}.jsonl",
            output_type="generate_until",
            doc_to_text="{{context}}\n",
            doc_to_target="{{target}}",
            generation_kwargs={"until": ["\n"], "max_gen_toks": 32, "do_sample": False},
            metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        ),
    }


def write_tasks(folder: str | Path, count: int = 200, seed: int = 0, val_every: int = 20) -> Path:
    """Write the three tasks (`count` documents each) into `folder`; return it for TaskManager(include_path=...)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    speeches = held_out_speeches(val_every)
    docs = {
        NEXT_LINE: next_line_docs(speeches, count, seed),
        PPL: ppl_docs(speeches, count),
        GEN: gen_docs(speeches, count),
    }
    for name, config in task_configs(folder).items():
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs[name])
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return folder
