"""The tooling of issue 34 as part of the suite: `ruff check` is clean over the repository
([tool.ruff] in pyproject.toml; `make lint` runs it before the tests) and no function is over 60
lines (scripts/function_lengths.py, also a pre-commit hook), with the length scan's own cases."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "function_lengths.py"


def load_script(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


function_lengths = load_script()
commit_subject = load_script(ROOT / "scripts" / "commit_subject.py")


def test_ruff_check_is_clean():
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr


def test_no_function_is_over_60_lines():
    scan = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True)
    assert scan.returncode == 0, scan.stdout + scan.stderr


def test_python_lengths_run_from_the_def_line_to_the_last():
    source = ("@decorator\ndef outer():\n    def inner():\n        pass\n    return 1\n\n\n"
              "class Box:\n    def get(self):\n        return 2\n")
    assert list(function_lengths.python_functions(source)) == [(2, "outer", 4), (3, "outer.inner", 2),
                                                               (9, "Box.get", 2)]


CPP = """#include <torch/extension.h>
#define BLOCK(x) { x; }
namespace {
// a comment with a brace {
struct Input {
  const float* q;
  float at(int i) const { return q[i]; }
};

template <typename T>
inline T twice(T a,
               T b) {
  auto add = [&](T x) { return x + b; };
  if (a > b) {
    return add(a);
  }
  const char* text = "}";
  return add(b);
}

template <>
inline float twice<float>(float a, float b) {
  return a + b;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("twice", &twice<float>);
}
"""


def test_cpp_lengths_count_whole_functions_not_their_blocks():
    """A function runs from its declaration's first line (the template line) to its closing brace;
    its lambdas and blocks are its own lines; comments, strings and macros are not code."""
    assert list(function_lengths.cpp_functions(CPP)) == [(7, "at", 1), (10, "twice", 10),
                                                                 (21, "twice<float>", 4), (27, "PYBIND11_MODULE", 3)]


def test_offenders_are_listed_with_path_line_name_and_length(tmp_path, capsys):
    (tmp_path / "long.py").write_text("def long():\n" + "    pass\n" * 60 + "\n\ndef short():\n    pass\n")
    (tmp_path / "sixty.cpp").write_text("void f() {\n" + "  g();\n" * 58 + "}\n")  # 60 lines: allowed
    assert function_lengths.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{tmp_path}/long.py:1 long (61 lines)"]
    assert function_lengths.main([str(tmp_path), "--max", "61"]) == 0


def test_commit_subjects_are_72_characters_at_most_and_one_line(tmp_path):
    assert commit_subject.subject_problem("x" * 72 + "\n\nthe details\n") is None
    assert "73 characters" in commit_subject.subject_problem("x" * 73 + "\n")
    assert commit_subject.subject_problem("# git's comment\n\nShort subject\n# " + "y" * 90) is None
    assert "blank line" in commit_subject.subject_problem("Short subject\nbody glued to it\n")
    assert commit_subject.subject_problem("# only a comment\n") == "the message is empty"
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("z" * 100 + "\n")
    hook = subprocess.run([sys.executable, str(ROOT / "scripts" / "commit_subject.py"), str(message)],
                          capture_output=True, text=True)
    assert hook.returncode == 1 and "100 characters" in hook.stderr
