"""The lines of a text file as chunkwise cuts them (`encode --text-file`, the tests' corpora).

A line ends at '\\n' only, not at '\\r', U+0085 or U+2028 (which str.splitlines would take); a final
'\\n' ends the last line rather than starting an empty one. No third-party imports, so that scripts
written apart from any tokenizer library (tests/data/spm_gguf_reference.py) can use it.
"""


def split_lines(text):
    """`text` cut into lines at '\\n'."""
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


def read_lines(path):
    """The lines of the UTF-8 file at `path`, its line ends kept as they are until the cut."""
    with open(path, encoding="utf-8", newline="") as f:
        return split_lines(f.read())
