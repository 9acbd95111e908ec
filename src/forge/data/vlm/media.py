"""Reading media: images through PIL, video through PyAV by timestamp. Every failure names the file."""

from pathlib import Path

import numpy as np


class MediaError(ValueError):
    """An image or video that cannot be read or decoded (the message names the file)."""


def load_image(path: str | Path):
    """An RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as err:
        raise MediaError(f"cannot read image {path}: {err}") from None


def frame_times(start: float, end: float, fps: float, min_frames: int, max_frames: int) -> list[float]:
    """Timestamps sampled at `fps` from start to end, always keeping the first and the last; at least min_frames
    and at most max_frames (evenly spaced when clamped)."""
    if end < start:
        raise ValueError(f"clip end {end} is before its start {start}")
    times = list(np.arange(start, end, 1.0 / fps))
    if not times or end - times[-1] > 1e-6:
        times.append(end)
    if len(times) > max_frames or len(times) < min_frames:
        count = max(min_frames, min(len(times), max_frames))
        times = list(np.linspace(start, end, count))
    return [float(t) for t in times]


def video_duration(path: str | Path) -> float:
    """Length of the first video stream in seconds."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if stream.duration is not None:
                return float(stream.duration * stream.time_base)
            return float(container.duration / av.time_base)
    except (av.error.FFmpegError, IndexError) as err:
        raise MediaError(f"cannot open video {path}: {err}") from None


def decode_frames(path: str | Path, times: list[float]):
    """The frames shown at each timestamp (the last frame at or before it), as RGB PIL images."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            container.seek(int(max(times[0], 0.0) / stream.time_base), stream=stream, backward=True)
            frames, wanted, current = [], list(times), None
            for frame in container.decode(stream):
                while wanted and frame.time is not None and frame.time > wanted[0] + 1e-6 and current is not None:
                    frames.append(current)
                    wanted.pop(0)
                if not wanted:
                    break
                current = frame.to_image()
            while wanted and current is not None:  # timestamps at or past the last frame
                frames.append(current)
                wanted.pop(0)
    except (av.error.FFmpegError, IndexError) as err:
        raise MediaError(f"cannot decode video {path}: {err}") from None
    if len(frames) != len(times):
        raise MediaError(f"cannot decode video {path}: no frame at {times[len(frames)]:.2f} s")
    return frames
