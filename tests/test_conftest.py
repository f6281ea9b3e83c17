"""tests/conftest.py gives each test session a maxperf cache directory of its own, and removes it at the end."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''import os
def test_probe():
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(os.environ["MAXPERF_CACHE_DIR"] + "\\n")
    assert os.path.isdir(os.environ["MAXPERF_CACHE_DIR"])
'''


def test_this_session_has_its_own_cache_dir():
    import conftest

    assert os.environ["MAXPERF_CACHE_DIR"] == conftest.SESSION_CACHE_DIR and Path(conftest.SESSION_CACHE_DIR).is_dir()


def test_two_sessions_get_two_cache_dirs_that_are_gone_afterwards(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "dirs.txt"
    users = tmp_path / "users-cache"  # a cache dir set in the environment is not the tests' to use
    env = {**os.environ, "PROBE_OUT": str(out), "MAXPERF_CACHE_DIR": str(users)}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    first, second = out.read_text().split()
    assert first != second and str(users) not in (first, second)
    assert not Path(first).exists() and not Path(second).exists()
