"""``wsi-pipeline verify``: read every tile store of a folder in full and check it against its checksums."""

from __future__ import annotations

import argparse
from pathlib import Path

from wsi_pipeline.cli._common import add_output_arguments

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check every tile store of a folder: files present, sizes, every tile's checksum",
        description=(
            "Read every <slide_id>.zarr store in DIR in full: each chunk and shard file the store recorded when it "
            "was written must be there with its size, and every tile must match its CRC-32C checksum. Every store "
            "is also checked cheaply each time a command opens it (files and sizes) and each tile when it is read; "
            "this command reads everything at once, e.g. after copying stores or on a suspect disk. Exit status 1 "
            "when any store is damaged; rerun `wsi-pipeline tile` on the same folder to rebuild damaged stores."
        ),
    )
    p.add_argument("--tiles", required=True, metavar="DIR", help="folder of tile stores written by `wsi-pipeline tile`")
    add_output_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsi_pipeline.data.store import INTEGRITY_SCHEME, marked_complete, verify_store
    from wsi_pipeline.progress import progress_bar

    folder = Path(args.tiles)
    if not folder.is_dir():
        raise FileNotFoundError(f"tiles folder not found: {folder}; pass the --out folder of `wsi-pipeline tile`")
    stores = sorted(p for p in folder.iterdir() if p.name.endswith(".zarr") and not p.name.startswith(".") and p.is_dir())
    if not stores:
        raise FileNotFoundError(f"no <slide_id>.zarr tile stores in {folder}")
    damaged, unchecked, tiles = [], [], 0
    for path in progress_bar(stores, enabled=not args.no_progress, desc="verify", unit="store"):
        n, problem = verify_store(path)
        tiles += n
        if problem is not None:
            damaged.append((path.name[: -len(".zarr")], problem))
        elif ((marked_complete(path) or {}).get("integrity") or {}).get("scheme") != INTEGRITY_SCHEME:
            unchecked.append(path.name[: -len(".zarr")])
    for sid, problem in damaged:
        print(f"  damaged  {sid}: {problem}")
    if unchecked:
        print(f"  {len(unchecked)} store(s) were written before stores carried checksums ({', '.join(unchecked[:3])}"
              f"{' ...' if len(unchecked) > 3 else ''}): their tiles decode, but damage inside a tile cannot be found; "
              "rebuild them with `wsi-pipeline tile --overwrite` to add checksums")
    print(f"{len(stores)} store(s) verified, {len(damaged)} damaged ({tiles} tiles read) in {folder}")
    return 1 if damaged else 0
