"""Where a py-spy recording's samples went: leaf frames and chosen callers, as shares of all samples.

    python3 benchmarks/stacks.py STACKS.txt [--within NAME] [--top 20]

STACKS.txt is ``py-spy record -f raw`` output (one collapsed stack and its count a line). ``--within``
keeps only the samples whose stack holds a frame named NAME (for example ``engine_steps``: the timed
loop, not the model's load). Prints the leaf frames (self time) and the frames that most samples pass
through (inclusive), each as a share of the kept samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path


def frame_name(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)``: lines of one function counted together."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def samples(path: Path):
    """``(frames, count)`` for each line of a ``py-spy record -f raw`` file."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--within", default="pipelined_steps|engine_steps")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    within = re.compile(args.within)
    leaf, through, total = Counter(), Counter(), 0
    for raw, n in samples(args.stacks):
        if not within.search(";".join(raw)):
            continue
        frames = [frame_name(f) for f in raw]
        total += n
        leaf[frames[-1]] += n
        for f in set(frames):
            through[f] += n
    print(f"{total} samples within {args.within!r}")
    for title, counts in (("leaf frames (self)", leaf), ("frames passed through (inclusive)", through)):
        print(f"-- {title}")
        for name, n in counts.most_common(args.top):
            print(f"{100 * n / max(total, 1):5.1f}%  {name[:150]}")


if __name__ == "__main__":
    main()
