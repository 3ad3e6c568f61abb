import re

import yaml

from conftest import ROOT


def _pins(lines):
    return dict(re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)$", line.strip()).groups()
                for line in lines if "==" in line)


def test_conda_envs_pin_what_requirements_pin():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert req["trl"] == "1.12.0" and req["torch"] == "2.13.0"
    envs = sorted((ROOT / "envs").glob("*.yaml"))
    assert envs
    for env in envs:
        spec = yaml.safe_load(env.read_text())
        pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
        assert _pins(pip) == req, env.name
        assert "python=3.11" in spec["dependencies"]
