"""Whole-process wall and CPU time of command lines, run alternately, medians printed as JSON.

    python scripts/time_commands.py --runs 5 --label after -- hypic-rag ask --index DIR "question" \\
        --label before -- env PYTHONPATH=/tmp/base python -m hypic_rag ask --index DIR "question"

Each `--label NAME -- COMMAND ...` group is one command; the groups run in turn (one run of each, then the next
round), so a busy machine slows all of them alike. CPU time (user + system, the children's) is less sensitive to
other processes than wall time and is reported beside it. Output goes to /dev/null; a failing run stops the script.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def parse(argv: list[str]) -> tuple[int, list[tuple[str, list[str]]]]:
    runs = 5
    commands: list[tuple[str, list[str]]] = []
    index = 0
    while index < len(argv):
        if argv[index] == "--runs":
            runs = int(argv[index + 1])
            index += 2
        elif argv[index] == "--label":
            label = argv[index + 1]
            if argv[index + 2] != "--":
                raise SystemExit("expected -- after --label NAME")
            end = index + 3
            while end < len(argv) and argv[end] != "--label":
                end += 1
            commands.append((label, argv[index + 3:end]))
            index = end
        else:
            raise SystemExit(f"unexpected argument {argv[index]!r} (see the module docstring)")
    if not commands or runs < 1:
        raise SystemExit("usage: time_commands.py [--runs N] --label NAME -- COMMAND ... [--label NAME -- ...]")
    return runs, commands


def timed(command: list[str]) -> tuple[float, float]:
    before = os.times()
    began = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - began
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    runs, commands = parse(sys.argv[1:])
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in commands}
    for _ in range(runs):
        for label, command in commands:
            samples[label].append(timed(command))
    report = {
        label: {
            "wall_median_s": round(statistics.median(wall for wall, _ in values), 3),
            "cpu_median_s": round(statistics.median(cpu for _, cpu in values), 3),
            "wall_s": [round(wall, 3) for wall, _ in values],
            "command": command,
        }
        for (label, command), values in zip(commands, samples.values())
    }
    print(json.dumps({"runs": runs, "load_average": os.getloadavg(), "results": report}, indent=2))


if __name__ == "__main__":
    main()
