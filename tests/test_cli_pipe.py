"""A reader that leaves early (`planner models | head -1`) ends the command quietly: no traceback."""

import subprocess
import sys


def test_closed_pipe_prints_no_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "planner", "models"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # like `head -1`: the reader is gone before the table is written
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 1)  # rich exits 1 on a broken pipe, as documented
