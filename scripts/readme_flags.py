"""The README's flags table, generated from the server's own ``--help`` text: one line per flag.

    .venv/bin/python scripts/readme_flags.py            # rewrite the table in README.md
    .venv/bin/python scripts/readme_flags.py --check    # exit 1 if the README's table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rope_plugins.server.config import ServerConfig, flag

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- flags: scripts/readme_flags.py -->", "<!-- end of flags -->"


def flags_table() -> str:
    """Flag, default and help of every field of ServerConfig, as a Markdown table."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for name, field in ServerConfig.model_fields.items():
        default = "" if field.default is None else str(field.default).lower() if isinstance(field.default, bool) \
            else f"{field.default}"
        meaning = (field.description or "").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
        rows.append(f"| `{flag(name)}` | {default} | {meaning} |")
    return "\n".join(rows)


def with_table(text: str) -> str:
    """The README's text with the table between its markers replaced by the generated one."""
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{flags_table()}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say whether the table is stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    if with_table(text) == text:
        return 0
    if args.check:
        print(f"{README.name}'s flags table differs from --help: run scripts/readme_flags.py", file=sys.stderr)
        return 1
    README.write_text(with_table(text))
    print(f"rewrote the flags table in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
