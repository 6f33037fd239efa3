"""Who holds the GIL in a served run: a ``py-spy record --gil --threads --subprocesses -f raw``
recording split by process and by thread, each thread named by what its stacks run (the scheduler's
worker, the HTTP event loop, the bench's client threads), with each one's busiest frames.

    python3 benchmarks/gil_share.py STACKS.txt [--top 12]

With ``--gil`` py-spy keeps only the thread that holds the GIL at each sample, so a thread's samples
over the recording's rate are the seconds it held the GIL; in one process those of all its threads
add up to at most the wall time. Prints, per process, the samples of each kind of thread and, for the
worker and the event loop, the frames that most of their samples pass through.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

from stacks import frame_name, samples  # benchmarks/, the script's own folder

KINDS = (  # the first pattern a stack (its thread's name first) matches names its thread's work
    ("worker: engine steps", re.compile(r"_step \(mesh_llm/runtime/worker\.py")),
    ("worker: load and warm-up", re.compile(r"^thread \(\d+\): worker-|worker\.py\)")),
    ("event loop", re.compile(r"uvicorn/server\.py|base_events\.py")),
    ("bench client", re.compile(r"bench/(concurrency|measure)\.py")),
)


def parse(path: Path):
    """(process, thread, frames, count) for each line of a raw recording; a subprocess's stacks sit
    under its parent's process frame, so the last process frame names the process."""
    for frames, count in samples(path):
        cut = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        process = frames[cut] if cut >= 0 else "process"
        frames = frames[cut + 1:]
        thread = frames.pop(0) if frames and frames[0].startswith("thread ") else "thread"
        yield process, thread, frames, count


def kind(thread: str, frames: list[str]) -> str:
    text = ";".join([thread, *frames])
    return next((name for name, pattern in KINDS if pattern.search(text)), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    samples: dict[str, Counter] = defaultdict(Counter)  # process -> kind -> samples
    through: dict[tuple[str, str], Counter] = defaultdict(Counter)  # (process, kind) -> frame -> samples
    names: dict[str, str] = {}
    for process, thread, frames, count in parse(args.stacks):
        k = kind(thread, frames)
        samples[process][k] += count
        for frame in {frame_name(f) for f in frames}:
            through[process, k][frame] += count
        names.setdefault(process, process[:120])
    for process, kinds in sorted(samples.items(), key=lambda p: -sum(p[1].values())):
        total = sum(kinds.values())
        print(f"\n{names[process]}: {total} samples holding the GIL")
        for k, n in kinds.most_common():
            print(f"  {k}: {n} ({100 * n / total:.0f}%)")
        for k in ("worker: engine steps", "event loop"):
            if kinds[k]:
                print(f"  {k}, frames most samples pass through:")
                for frame, n in through[process, k].most_common(args.top):
                    print(f"    {100 * n / kinds[k]:5.1f}%  {frame[:110]}")


if __name__ == "__main__":
    main()
