"""README.md's quickstart runs as pasted.

The block after the `<!-- quickstart: executed by tests/test_readme.py -->` marker runs in a
fresh Python process in a temporary directory, without TRITON_INTERPRET (so, on a CPU, the
ops take the PyTorch path a user gets; on a CUDA machine, the GPU kernels).
"""
import os
import re
import subprocess
import sys

import sailfish

MARKER = "<!-- quickstart: executed by tests/test_readme.py -->"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def quickstart_code() -> str:
    text = open(README, encoding="utf-8").read()
    assert text.count(MARKER) == 1, f"README.md must mark exactly one block with {MARKER}"
    m = re.match(r"\s*```python\n(.*?)\n```", text[text.index(MARKER) + len(MARKER):], re.S)
    assert m, "the marker must be followed by a ```python block"
    return m.group(1)


def test_readme_quickstart_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "max |y - ref|:" in proc.stdout and "'quantized': ['0', '2']" in proc.stdout
    # a user pastes it into their own directory: it must leave nothing there (issue 37: model.pt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quickstart.py"]
