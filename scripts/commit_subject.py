"""A commit message's subject is 72 characters at most, with the details in the body after a
blank line (pre-commit's commit-msg stage runs this on the message file).

    .venv/bin/python scripts/commit_subject.py .git/COMMIT_EDITMSG
"""

from __future__ import annotations

import sys
from pathlib import Path

LONGEST = 72


def subject_problem(message: str) -> str | None:
    """What is wrong with the message's subject line, or None. Git's comment lines are skipped."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines:
        return "the message is empty"
    if len(lines[0]) > LONGEST:
        return f"the subject is {len(lines[0])} characters; at most {LONGEST}, the details in the body"
    if len(lines) > 1 and lines[1].strip():
        return "the subject is one line: leave a blank line before the body"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    problem = subject_problem(Path(argv[0]).read_text())
    if problem:
        print(f"commit message: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
