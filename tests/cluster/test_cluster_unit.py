"""That Ray stays out of `import kvrun` and of `kvrun serve` without --ray (runtime/cluster/
is imported only past --ray). Each cluster module's own cases are in its test_<module>.py."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [[], ["serve", "--port", "0"], ["serve", "--replicas", "3"]])
def test_ray_stays_out(argv):
    """`import kvrun`, and `kvrun serve` without --ray (here stopped by a bad flag after its
    options are parsed), never import ray."""
    code = ("import sys, kvrun, kvrun.cli.main as m\n"
            f"argv = {argv!r}\n"
            "if argv:\n"
            "    try:\n"
            "        m.main(argv, standalone_mode=False)\n"
            "    except BaseException as e:\n"
            "        print('failed:', repr(e))\n"
            "print('ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
    if argv:
        assert "failed:" in out.stdout
