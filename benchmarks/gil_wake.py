"""How long an asyncio event loop, woken by a worker thread that then goes on holding the GIL, takes
to run the callback it was woken for: with the worker stepping on at once, and with it waiting
(GIL released, at most 5 ms) until the loop has taken the item, as ``runtime/worker.py``'s hand-over
does. Pure Python busy work stands in for building a step's graph.

    python3 benchmarks/gil_wake.py [--items 40]

Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def delays(items: int, hand_over: bool) -> list[float]:
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()
    taken = threading.Event()

    def worker() -> None:
        for _ in range(items):
            busy(0.003)
            taken.clear()
            loop.call_soon_threadsafe(arrived.put_nowait, time.perf_counter())
            if hand_over:
                taken.wait(0.005)
            busy(0.008)  # the next step's build
        loop.call_soon_threadsafe(arrived.put_nowait, None)

    thread = threading.Thread(target=worker)
    thread.start()
    out = []
    while (sent := await arrived.get()) is not None:
        out.append(time.perf_counter() - sent)
        taken.set()
    thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40)
    args = parser.parse_args()
    for hand_over in (False, True, False, True):
        d = asyncio.run(delays(args.items, hand_over))
        print(f"{'hand-over' if hand_over else 'steps on '}: median {1000 * statistics.median(d):.3f} ms, "
              f"max {1000 * max(d):.3f} ms")


if __name__ == "__main__":
    main()
