"""`forge-convert --to {hf,dcp,torch,safetensors} SRC DST`."""

import argparse
import sys

from forge.checkpoint.convert import FORMATS, convert
from forge.checkpoint.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forge-convert",
        description="Convert a model between a run directory / DCP checkpoint, a consolidated torch or safetensors "
        "file, and a Hugging Face folder of any family forge-train has.",
    )
    parser.add_argument("--to", required=True, choices=FORMATS, help="output format")
    parser.add_argument("src", help="run directory, checkpoint folder, consolidated file or Hugging Face folder")
    parser.add_argument("dst", help="output file (torch, safetensors) or folder (hf, dcp); must not exist yet")
    parser.add_argument("--overwrite", action="store_true", help="replace dst if it exists (once the output is whole)")
    args = parser.parse_args(argv)
    try:
        convert(args.to, args.src, args.dst, overwrite=args.overwrite)
    except (CheckpointError, OSError) as err:
        print(f"forge-convert: {err}", file=sys.stderr)
        return 1
    print(f"forge-convert: wrote {args.to} to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
