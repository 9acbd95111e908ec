"""Image/video-text examples: media preprocessed with the encoder's own image processor, text tokenised to a fixed
length, batches in a seeded order that resumes exactly (the same global order for any number of ranks).

A batch is a dict: pixels (batch, frames, 3, H, W), frame_mask (batch, frames) True for real frames,
frame_times (batch, frames) seconds, tokens and labels (batch, text_len). Labels are -100 on padding and, with
answer_only_loss, on the prompt. Media that cannot be read are skipped and counted (on_bad_media=skip, the default
for training data) or raise an error naming the file (on_bad_media=error).

Each rank preprocesses only its own records. It also needs to know whether the other ranks' records of the batch
can be read (an unreadable one shifts every later slot), so it decodes those once, without the image processor,
and remembers the answer. Preprocessed media are kept in a cache bounded in bytes, which small data sets reuse
across epochs.
"""

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from forge.config.schema import BadMediaPolicy
from forge.data.order import EpochOrder
from forge.data.vlm.media import MediaError, decode_frames, frame_times, load_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaRecord:
    """One example: an image (end is None) or a video clip [start, end] seconds, a prompt and its target text."""

    path: str
    prompt: str
    target: str
    start: float = 0.0
    end: float | None = None


MediaKey = tuple[str, float, float | None]


def media_key(record: MediaRecord) -> MediaKey:
    """What identifies a record's media: the file and the clip."""
    return record.path, record.start, record.end


class MediaCache:
    """Least-recently-used preprocessed media, at most `max_bytes` of tensors."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[MediaKey, tuple[tuple, int]] = OrderedDict()  # key -> (tensors, their bytes)

    def get(self, key: MediaKey) -> tuple | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: MediaKey, value: tuple) -> None:
        size = sum(t.numel() * t.element_size() for t in value)
        if size > self.max_bytes:
            return
        self.entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped


class VLMCorpus:
    """Train and validation records with their tokenizer and image processor."""

    def __init__(
        self,
        train: list[MediaRecord],
        val: list[MediaRecord],
        tokenizer,
        image_processor,
        vocab_size: int,
        eos_id: int,
        *,
        max_frames: int,
        min_frames: int,
        fps: float,
        answer_only_loss: bool,
        on_bad_media: str,
        media_cache_mb: int = 512,
    ):
        if on_bad_media not in tuple(BadMediaPolicy):
            raise ValueError(f"data.on_bad_media={on_bad_media!r} is not one of {', '.join(BadMediaPolicy)}")
        if not train or not val:
            raise ValueError(f"the data has {len(train)} training and {len(val)} validation records; both need some")
        if tokenizer.get_vocab_size() > vocab_size:
            raise ValueError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()}"
            )
        self.train_records, self.val_records = train, val
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.max_frames, self.min_frames, self.fps = max_frames, min_frames, fps
        self.answer_only_loss = answer_only_loss
        self.on_bad_media = on_bad_media
        self.skipped = 0
        self._cache = MediaCache(media_cache_mb * 2**20)
        self._unreadable: dict[MediaKey, str] = {}
        """Media known not to decode, with the error; readable ones are in `_readable`."""
        self._readable: set[MediaKey] = set()

    def _decode(self, record: MediaRecord) -> tuple[list, list[float]]:
        """The record's decoded frames (PIL images) and their times in seconds."""
        if record.end is None:
            images, times = [load_image(record.path)], [0.0]
        else:
            times = frame_times(record.start, record.end, self.fps, self.min_frames, self.max_frames)
            images = decode_frames(record.path, times)
        if len(images) > self.max_frames:
            raise MediaError(f"{record.path}: {len(images)} frames exceed data.max_frames={self.max_frames}")
        return images, times

    def _media(self, record: MediaRecord):
        key = media_key(record)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        images, times = self._decode(record)
        start = record.start
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        frames = torch.zeros(self.max_frames, *pixels.shape[1:], dtype=pixels.dtype)
        frames[: len(images)] = pixels
        mask = torch.zeros(self.max_frames, dtype=torch.bool)
        mask[: len(images)] = True
        stamps = torch.zeros(self.max_frames)
        stamps[: len(images)] = torch.tensor(times) - start
        self._cache.put(key, (frames, mask, stamps))
        return frames, mask, stamps

    def _skip(self, key: MediaKey, err: MediaError) -> None:
        """Count (and log) one skip of unreadable media, or raise under on_bad_media=error."""
        self._unreadable[key] = str(err)
        if self.on_bad_media == "error":
            raise err
        self.skipped += 1
        log.warning("skipped (%d so far): %s", self.skipped, err)

    def readable(self, record: MediaRecord) -> bool:
        """Whether the record's media decode, as example() would find; decoded once, then remembered. An unreadable
        record counts as a skip each time, as in example()."""
        key = media_key(record)
        if key in self._readable:
            return True
        if key in self._unreadable:
            self._skip(key, MediaError(self._unreadable[key]))
            return False
        try:
            self._decode(record)
        except MediaError as err:
            self._skip(key, err)
            return False
        self._readable.add(key)
        return True

    def text(self, record: MediaRecord, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of prompt + target + EOS, cut or padded to text_len."""
        prompt = self.tokenizer.encode(record.prompt).ids
        target = self.tokenizer.encode(record.target).ids + [self.eos_id]
        ids = (prompt + target)[: text_len + 1]
        labels = list(ids[1:])
        if self.answer_only_loss:
            labels[: max(len(prompt) - 1, 0)] = [-100] * min(max(len(prompt) - 1, 0), len(labels))
        pad = text_len + 1 - len(ids)
        tokens = torch.tensor(ids[:text_len] + [self.eos_id] * max(pad - 0, 0))[:text_len]
        labels = torch.tensor(labels + [-100] * (text_len - len(labels)))
        return tokens, labels

    def example(self, record: MediaRecord, text_len: int) -> dict | None:
        """One example's tensors, or None for unreadable media under on_bad_media=skip."""
        key = media_key(record)
        if key in self._unreadable:
            self._skip(key, MediaError(self._unreadable[key]))
            return None
        try:
            pixels, mask, stamps = self._media(record)
        except MediaError as err:
            self._skip(key, err)
            return None
        self._readable.add(key)
        tokens, labels = self.text(record, text_len)
        return {"pixels": pixels, "frame_mask": mask, "frame_times": stamps, "tokens": tokens, "labels": labels}

    def make_loader(
        self, seq_len: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int, dp_size: int
    ) -> "VLMLoader":
        return VLMLoader(self, seq_len, micro_batch, seed, dp_rank, dp_size)

    def val_batches(self, seq_len: int, micro_batch: int, count: int, dp_rank: int, dp_size: int) -> Iterator[dict]:
        """The first `count` validation micro-batches of this rank (text of seq_len tokens), the same at every
        evaluation."""
        records = self.val_records
        per_rank = max(1, min(count, len(records) // (micro_batch * dp_size)))
        for b in range(per_rank):
            start = (b * dp_size + dp_rank) * micro_batch
            examples = [self.example(r, seq_len) for r in records[start : start + micro_batch]]
            yield collate([e for e in examples if e is not None])


def collate(examples: list[dict]) -> dict:
    if not examples:
        raise MediaError("a whole micro-batch of media was unreadable")
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


class VLMLoader:
    """Seeded per-epoch permutation of the training records; rank r takes its slice of each global batch. An
    unreadable record is replaced by the next one of the permutation (deterministically, so resumes stay exact)."""

    lr_scale = 1.0
    """Learning-rate factor asked by the data (mixture phases); always 1 here."""

    def __init__(self, corpus: VLMCorpus, text_len: int, micro_batch: int, seed: int, dp_rank: int, dp_size: int):
        if micro_batch * dp_size > len(corpus.train_records):
            raise ValueError(f"{len(corpus.train_records)} records cannot fill a batch of {micro_batch} x {dp_size}")
        self.corpus, self.text_len, self.micro_batch = corpus, text_len, micro_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.position = EpochOrder(len(corpus.train_records), [seed])

    def next_batch(self) -> dict:
        """This rank's micro-batch; every rank walks the whole global batch so unreadable media shift all alike."""
        examples: list[dict] = []
        records = self.corpus.train_records
        for slot in range(self.micro_batch * self.dp_size):
            mine = slot // self.micro_batch == self.dp_rank
            while True:
                record = records[self.position.next_index()]
                if mine:
                    example = self.corpus.example(record, self.text_len)
                    if example is not None:
                        examples.append(example)
                        break
                elif self.corpus.readable(record):  # another rank's record: only whether it decodes matters
                    break
        return collate(examples)

    def metrics(self) -> dict:
        return {"media_skipped": self.corpus.skipped}

    def state_dict(self) -> dict:
        return {"epoch": self.position.epoch, "cursor": self.position.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.position.seek(state["epoch"], state["cursor"])
