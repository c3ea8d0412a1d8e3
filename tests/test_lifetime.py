"""Child processes do not outlive their owner."""

import subprocess
import sys
import time

# The owner starts a child that watches it, prints the child's pid and dies at once; the child
# would sleep a minute if nothing stopped it.
CHILD = """
import os, time
from matrixinfer.lifetime import exit_with_parent
exit_with_parent(int(os.environ["OWNER"]), interval_s=0.1)
time.sleep(60)
"""
OWNER = f"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.DEVNULL, env={{**os.environ, "OWNER": str(os.getpid())}})
print(child.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_exits_when_its_owner_dies_while_it_is_busy():
    """exit_with_parent: a child busy in work that reads no pipe (an engine core compiling at
    start-up) goes within a moment of its owner's death instead of running on as an orphan."""
    owner = subprocess.run([sys.executable, "-c", OWNER], capture_output=True, text=True, timeout=60)
    pid = int(owner.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        subprocess.run(["kill", "-9", str(pid)])
        raise AssertionError("the child outlived its owner")
