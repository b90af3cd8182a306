"""The coordinator's side of `environment:` (orchestrator/environment/): what pip is asked for, the
tags of a host's interpreter, and real pip resolving from the tests' wheelhouse alone (`no_index`;
the tests marked `wheelhouse` need it made: tests/wheelhouse.py)."""

from __future__ import annotations

import sys

import pytest

from orchestrator.environment.request import request_of
from orchestrator.environment.resolve import resolve
from orchestrator.environment.target import Target, platform_tags
from orchestrator.errors import LaunchError
from orchestrator.spec.environment import EnvironmentSpec
from tests import wheelhouse
from worker.host import environment


def test_a_hosts_tags_widen_to_every_older_manylinux():
    tags = platform_tags("linux-x86_64", "2.36")
    assert tags[0] == "manylinux_2_36_x86_64" and tags[-1] == "linux_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert platform_tags("linux-aarch64", None) == ("linux_aarch64",)  # musl or unknown: its own tag only
    assert platform_tags("macosx-11.0-arm64", None) == ("macosx_11_0_arm64",)


def test_the_runtime_needs_are_added_unless_named(tmp_path):
    plain = request_of(EnvironmentSpec(requirements=["numpy<3"]))
    assert plain.added == ("tensorflow", "psutil", "py-spy")
    named = request_of(EnvironmentSpec(requirements=["tensorflow_cpu==2.21.0", "PSUTIL>=5"]))
    assert named.added == ("py-spy",)
    (tmp_path / "base.txt").write_text("tensorflow==2.21.0\n")
    top = tmp_path / "requirements.txt"
    top.write_text("# ours\n-r base.txt\nnumpy  # pinned by TF\n")
    from_file = request_of(EnvironmentSpec(requirements=top))
    assert from_file.requirements == ("-r", str(top)) and from_file.added == ("psutil", "py-spy")
    (tmp_path / "base.txt").write_text("tensorflow==2.20.0\n")  # an include changed: resolved again
    assert request_of(EnvironmentSpec(requirements=top)).digest != from_file.digest


def test_pips_options_go_in_keys_of_their_own():
    with pytest.raises(ValueError, match="use index_url, find_links, no_index"):
        EnvironmentSpec(requirements=["--index-url=http://x", "numpy"])


def _here() -> Target:
    return Target.of(environment.target())  # this interpreter's, as a host reports its own


@pytest.mark.wheelhouse
def test_resolved_once_then_from_the_cache_alone(tmp_path):
    links = wheelhouse.ensure()
    env = EnvironmentSpec(requirements=[wheelhouse.requirements()[0]], find_links=[links], no_index=True)
    first = resolve(request_of(env), _here(), tmp_path, who="h0")
    names = {w.name.lower().replace("_", "-") for w in first.wheels}
    assert {"psutil", "py-spy", "tensorflow-cpu"} <= names and first.uv.file.startswith("uv-")
    assert set(first.seconds) == {"resolve", "download"} and first.downloaded == first.size + first.uv.size
    assert all((tmp_path / "cache" / w.sha256).stat().st_size == w.size for w in first.wheels)
    again = resolve(request_of(env), _here(), tmp_path, who="h0")
    assert again == first and again.seconds == {} and again.downloaded == 0  # no pip at all
    assert again.key("/usr/bin/python3") != again.key("/opt/python3.11/bin/python3")


@pytest.mark.wheelhouse
def test_a_host_whose_platform_has_no_wheel_stops_the_launch_naming_it(tmp_path):
    env = EnvironmentSpec(requirements=["psutil"], find_links=[wheelhouse.ensure()], no_index=True)
    arm = Target("cp", "3.11", "cp311", platform_tags("linux-aarch64", "2.36"))
    with pytest.raises(LaunchError) as caught:
        resolve(request_of(env), arm, tmp_path, who="pi-1, pi-2")
    said = str(caught.value)
    assert "pi-1, pi-2" in said and "manylinux_2_36_aarch64" in said and "nothing was started" in said
    assert "psutil" in said and "no wheels with a matching platform tag" in said, said  # uv's words


class FakeSite:
    """A host for `prepare`'s policy: answers as worker/host/environment.py would, records what it did."""

    def __init__(self, label: str, folder: str):
        self.label, self.python, self.folder = label, "python3", folder
        self.did: list[str] = []
        self.built: set[str] = set()

    def ask(self, mode, key, manifest, on_line):
        self.did.append(mode)
        if mode == "build":
            self.built.add(key)
            SHARED.setdefault(self.folder, set()).add(key)
        ready = key in SHARED.get(self.folder, set())
        target = {**environment.target(), "executable": "/usr/bin/python3"}
        return {"target": target, "ready": ready, "python": f"/{self.folder}/envs/{key}/bin/python",
                "missing": [] if ready else ["x"], "folder": self.folder}  # fmt: skip

    def send(self, files, missing, progress):
        self.did.append("send")
        return 0


SHARED: dict[str, set[str]] = {}


def test_hosts_that_share_their_folder_build_there_once_and_a_second_run_asks_once(tmp_path, monkeypatch):
    from orchestrator.environment import prepare as module
    from orchestrator.environment.resolve import Resolved, Wheel

    wheel = Wheel(
        "tensorflow-cpu", "2.21.0", "tensorflow_cpu-2.21.0-cp311-cp311-manylinux_2_27_x86_64.whl", "a" * 64, 9
    )
    uv = Wheel("uv", "0.13.9", "uv.whl", "b" * 64, 1)
    monkeypatch.setattr(module, "resolve", lambda *a, **k: Resolved((wheel,), uv, {"resolve": 0.1}))
    sites = [FakeSite("n1", "nfs"), FakeSite("n2", "nfs"), FakeSite("n3", "local-3")]
    env = EnvironmentSpec(requirements=["tensorflow-cpu"])
    said: list[str] = []
    hosts = module.prepare(env, sites, said.append, tmp_path)
    assert [h.state for h in hosts] == ["ready", "ready", "ready"]
    assert len({h.key for h in hosts}) == 1
    assert sites[0].did == ["ready", "ready", "send", "build"] and sites[2].did == sites[0].did
    assert sites[1].did == ["ready", "ready"] and not sites[1].built  # n1 built it for both
    for site in sites:
        site.did.clear()
    again = module.prepare(env, sites, said.append, tmp_path)
    assert [s.did for s in sites] == [["ready"]] * 3  # one question each, no resolution
    assert [h.python for h in again] == [h.python for h in hosts]


def test_a_wheel_dropped_into_find_links_resolves_again(tmp_path):
    env = EnvironmentSpec(requirements=["tiny-pkg"], find_links=[tmp_path], no_index=True)
    before = request_of(env).digest
    wheelhouse.tiny_wheel(tmp_path, "tiny_pkg", "2.0")
    assert request_of(env).digest != before


@pytest.mark.wheelhouse
def test_markers_are_judged_for_the_hosts_python_not_this_ones(tmp_path):
    """tiny_pkg needs only_there on the hosts' Python (one minor version past this one, never
    this one) and only_here on any other: each target gets its own and not the other, on any
    Python this runs on (pip alone would judge both markers by this machine's)."""
    there = f"3.{sys.version_info.minor + 1}"
    links = tmp_path / "wheels"
    links.mkdir()
    markers = (f'only_there ; python_version == "{there}"', f'only_here ; python_version != "{there}"')
    wheelhouse.tiny_wheel(links, "tiny_pkg", "1.0", markers)
    wheelhouse.tiny_wheel(links, "only_there", "1.0")
    wheelhouse.tiny_wheel(links, "only_here", "1.0")
    wheelhouse.tiny_wheel(links, "tensorflow_cpu", "9.9")  # a TensorFlow named: nothing heavy added
    found = [links, wheelhouse.ensure()]
    env = EnvironmentSpec(requirements=["tiny-pkg", "tensorflow-cpu"], find_links=found, no_index=True)
    here = _here()
    host = Target(here.implementation, there, f"cp3{sys.version_info.minor + 1}", here.platforms)
    for target, wanted, unwanted in ((here, "only-here", "only-there"), (host, "only-there", "only-here")):
        names = {
            w.name.replace("_", "-") for w in resolve(request_of(env), target, tmp_path / "c", who="h").wheels
        }
        assert {"tiny-pkg", "psutil", "py-spy", wanted} <= names and unwanted not in names, (
            target.version,
            names,
        )


def test_a_host_whose_python_is_too_old_for_the_worker_is_named(tmp_path):
    from orchestrator.environment.prepare import prepare

    class Old(FakeSite):
        def ask(self, mode, key, manifest, on_line):
            answer = super().ask(mode, key, manifest, on_line)
            return {**answer, "target": {**answer["target"], "version": "3.8", "abi": "cp38"}}

    with pytest.raises(LaunchError, match=r"h9: python3 is Python 3.8"):
        prepare(EnvironmentSpec(requirements=["tensorflow-cpu"]), [Old("h9", "x")], lambda _: None, tmp_path)
