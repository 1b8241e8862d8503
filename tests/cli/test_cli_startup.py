"""`kvrun --help` and `import kvrun` start without torch: the package's public names and
the CLI's option types are imported when first used (runtime/__init__.py,
runtime/cli/kv_flags.py LazyChoice, runtime/cli/common.py ThreadCount)."""
from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
{body}
print("torch" in sys.modules)
"""


def _torch_loaded(body: str) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1] == "True"


def test_import_kvrun_does_not_load_torch():
    assert not _torch_loaded("import kvrun")


def test_kvrun_help_does_not_load_torch():
    body = ("sys.argv = ['kvrun', '--help']\n"            # the console script's own entry
            "from kvrun.cli.entry import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0")
    assert not _torch_loaded(body)


def test_a_public_name_loads_on_first_use():
    assert _torch_loaded("import kvrun\nassert callable(kvrun.load) and kvrun.Model")


def test_lazy_choices_still_check_values():
    from click.testing import CliRunner

    from kvrun.cli.main import main
    r = CliRunner().invoke(main, ["generate", "-p", "x", "--ctx-policy", "nope"])
    assert r.exit_code != 0 and "'error', 'shift'" in r.output
    r = CliRunner().invoke(main, ["generate", "-p", "x", "-t", "5000"])
    assert r.exit_code != 0 and "1<=x<=1024" in r.output
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert "streaming, h2o" in r.output and "[error|shift]" in r.output
