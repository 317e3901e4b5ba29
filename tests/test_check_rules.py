"""check's rules are pure: facts in, problems out."""

from __future__ import annotations

import copy

import pytest

from mnft.check.findings import CheckOptions, CheckReport, Reach
from mnft.check.rules import evaluate, master_address
from mnft.core.errors import ExitCode, InputError
from mnft.hosts import inventory
from mnft.hosts.fleet import HostResult, Status

GIB = 1024**3

FACTS = {
    "hostname": "n",
    "python": {"executable": "/usr/bin/python3", "version": "3.11.7"},
    "torch": {"version": "2.13.0+cu124", "cuda": "12.4", "location": "/x"},
    "nccl": "2.21.5",
    "cudnn": "9.1.0",
    "nvidia": {"driver": "550.54", "cuda_driver": "12.4", "gpus": [{"index": i, "name": "H100", "uuid": f"u{i}", "memory_total_mib": 81559, "memory_used_mib": 0, "processes": []} for i in range(2)]},
    "cpu_count": 32,
    "memory": {"total_bytes": 512 * GIB, "available_bytes": 500 * GIB},
    "disk": {"path": "/home/u", "free_bytes": 500 * GIB, "total_bytes": 1000 * GIB},
    "interfaces": [{"name": "lo", "up": True, "ipv4": ["127.0.0.1/8"]}, {"name": "eth0", "up": True, "ipv4": ["10.0.0.1/24"]}],
    "clock": 0.0,
    "rsync": "/usr/bin/rsync",
    "errors": {},
}

INV = inventory.parse("vars: {slots: 2}\nhosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n  c: {address: 10.0.0.3}\n")


def facts(**changes):
    f = copy.deepcopy(FACTS)
    for dotted, value in changes.items():
        target = f
        *path, last = dotted.split("__")
        for key in path:
            target = target[key]
        target[last] = value
    return f


def run(all_facts, options=CheckOptions(network=False), **report_fields):
    report = CheckReport(INV, {h.name: HostResult(h.name, Status.OK) for h in INV.hosts}, all_facts, **report_fields)
    return evaluate(INV, all_facts, report, options)


def fields_of(problems):
    return sorted((p.host, p.field) for p in problems if p.severity == "error")


def test_identical_healthy_hosts_have_no_problem():
    assert run({"a": facts(), "b": facts(), "c": facts()}) == []


def test_version_drift_names_the_host_and_the_field():
    problems = run({"a": facts(), "b": facts(torch__version="2.12.0+cu124"), "c": facts(nccl="2.18.1", python__version="3.10.4")})
    assert fields_of(problems) == [("b", "torch"), ("c", "nccl"), ("c", "python")]
    torch = next(p for p in problems if p.field == "torch")
    assert torch.message == "torch 2.12.0+cu124 differs from the master's 2.13.0+cu124"
    assert "pip install torch==2.13.0+cu124" in torch.fix


def test_python_patch_releases_may_differ():
    assert run({"a": facts(), "b": facts(python__version="3.11.9"), "c": facts()}) == []


def test_a_package_with_a_rule_of_its_own_is_reported_once_and_other_packages_by_the_environment_rule():
    dists = {"torch": "2.13.0+cu124", "nvidia-nccl-cu12": "2.21.5", "numpy": "2.1.0"}
    drifted = {"torch": "2.12.0+cu124", "nvidia_nccl_cu12": "2.18.1", "numpy": "2.1.0"}
    problems = run({"a": facts(dists=dists), "b": facts(dists=dict(dists, numpy="1.26.4")),
                    "c": facts(dists=drifted, torch__version="2.12.0+cu124", nccl="2.18.1")})
    assert fields_of(problems) == [("b", "env"), ("c", "nccl"), ("c", "torch")]
    assert "numpy 1.26.4" in next(p.message for p in problems if p.field == "env")


def test_driver_and_cuda_drift_are_found():
    problems = run({"a": facts(), "b": facts(nvidia__driver="535.1"), "c": facts(torch__cuda="12.1")})
    assert fields_of(problems) == [("b", "driver"), ("c", "cuda")]


def test_missing_torch_is_a_problem():
    problems = run({"a": facts(), "b": facts(torch={"version": None, "cuda": None, "location": None}), "c": facts()})
    assert ("b", "torch") in fields_of(problems)


def test_fewer_gpus_than_slots_and_busy_gpus():
    busy = copy.deepcopy(FACTS["nvidia"]["gpus"])
    busy[1]["processes"] = [{"pid": 4242, "name": "python", "used_mib": 1000}]
    problems = run({"a": facts(), "b": facts(nvidia__gpus=busy[:1]), "c": facts(nvidia__gpus=busy)})
    assert fields_of(problems) == [("b", "gpus")]
    warning = [p for p in problems if p.severity == "warning"]
    assert [(p.host, p.field) for p in warning] == [("c", "gpus")] and "4242" in warning[0].message


def test_cpu_only_cluster_does_not_need_gpus():
    cpu = dict(torch={"version": "2.13.0+cpu", "cuda": None, "location": "/x"}, nccl=None, nvidia={"driver": None, "cuda_driver": None, "gpus": []})
    assert run({h: facts(**cpu) for h in "abc"}) == []


def test_disk_floor_rsync_and_interface():
    problems = run(
        {"a": facts(disk__free_bytes=1 * GIB), "b": facts(rsync=None), "c": facts()},
        CheckOptions(network=False, min_free_gb=10),
    )
    assert fields_of(problems) == [("a", "disk"), ("b", "rsync")]
    inv = inventory.parse("hosts:\n  a: {address: 10.0.0.1, iface: ib0}\n")
    report = CheckReport(inv, {"a": HostResult("a", Status.OK)}, {"a": facts()})
    problems = evaluate(inv, {"a": facts()}, report, CheckOptions(network=False))
    assert [(p.host, p.field) for p in problems] == [("a", "iface")] and "has: lo, eth0" in problems[0].message


def test_clock_skew_is_measured_against_the_master():
    problems = run({h: facts() for h in "abc"}, skew={"a": 0.1, "b": 0.4, "c": 5.0})
    assert fields_of(problems) == [("c", "clock")]


def test_network_problems_name_the_port_and_the_unreachable_host():
    problems = run(
        {h: facts() for h in "abc"},
        CheckOptions(network=True),
        master_addr="10.0.0.1",
        port=29500,
        port_free=True,
        reach={"a": Reach(True), "b": Reach(False, error="timed out"), "c": Reach(True)},
    )
    assert fields_of(problems) == [("b", "network")]
    assert "cannot reach the master 10.0.0.1:29500" in problems[0].message and "firewall" in problems[0].fix
    busy = run({h: facts() for h in "abc"}, CheckOptions(network=True), master_addr="10.0.0.1", port=29500, port_free=False, port_error="address in use")
    assert fields_of(busy) == [("a", "port")]


def test_master_address_prefers_iface_then_literal_then_the_single_interface():
    assert master_address(INV, facts()) == ("10.0.0.1", None)
    named = inventory.parse("hosts:\n  m: {address: m.lab, iface: eth0}\n  p: {}\n")
    assert master_address(named, facts()) == ("10.0.0.1", None)
    by_name = inventory.parse("hosts:\n  m: {address: m.lab}\n  p: {}\n")
    assert master_address(by_name, facts()) == ("10.0.0.1", None)
    two = facts(interfaces=[*FACTS["interfaces"], {"name": "ib0", "up": True, "ipv4": ["192.168.9.1/24"]}])
    addr, why = master_address(by_name, two)
    assert addr is None and "set 'iface'" in why
    local = inventory.parse("hosts: {me: {connection: local}}\n")
    assert master_address(local, None) == ("127.0.0.1", None)


# ------------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"port": 70000}, "--port"),
        ({"port": -1}, "--port"),
        ({"min_free_gb": -1.0}, "--min-free-gb"),
        ({"min_free_gb": float("nan")}, "--min-free-gb"),
        ({"max_clock_skew_s": 0.0}, "--max-clock-skew"),
    ],
)
def test_bad_check_arguments_are_bad_input_before_any_host(kwargs, flag):
    with pytest.raises(InputError, match=f"^{flag}: ") as err:
        CheckOptions(**kwargs)
    assert err.value.exit_code == ExitCode.BAD_INPUT


@pytest.mark.parametrize("kwargs, flag", [({"connect": 0}, "--connect-timeout"), ({"connect": -3.0}, "--connect-timeout"), ({"command": 0.0}, "--timeout"), ({"connect": float("inf")}, "--connect-timeout")])
def test_non_positive_timeouts_are_bad_input(kwargs, flag):
    from mnft.hosts.connection import Timeouts

    with pytest.raises(InputError, match=f"^{flag}: .* must be a number of seconds > 0"):
        Timeouts(**kwargs)


def test_good_check_arguments_pass():
    assert CheckOptions(port=1, min_free_gb=0, max_clock_skew_s=0.5).port == 1
    assert CheckOptions(port=65535).port == 65535


# ------------------------------------------------------------------------------------------------ clock


def test_clock_skew_accounts_for_the_probe_reading_its_clock_at_its_end():
    from mnft.check.rules import clock_skew

    # Controller: sent at 1000.0, answer at 1005.0. The probe ran 4.5 s (a slow nvidia-smi) and read its clock
    # at its end; 0.5 s of transport/startup is split 0.25 before and 0.25 after. A host whose clock agrees
    # with the controller's reads 1004.75.
    assert clock_skew(1004.75, 1000.0, 1005.0, 4.5) == 0.0
    assert clock_skew(1007.75, 1000.0, 1005.0, 4.5) == 3.0  # a host 3 s ahead
    assert clock_skew(1004.75, 1000.0, 1005.0, None) == 2.25  # the midpoint's bias, when the probe says nothing
    assert clock_skew(1004.75, 1000.0, 1005.0, 9.0) == 2.25  # an impossible probe time: the midpoint


def test_a_slow_probe_is_no_clock_problem():
    from mnft.check.rules import clock_skew

    skew = {name: clock_skew(1004.75, 1000.0, 1005.0, 4.5) for name in ("a", "b")} | {"c": clock_skew(1000.3, 1000.0, 1000.5, 0.1)}
    report = CheckReport(INV, {n: HostResult(n, Status.OK) for n in "abc"}, {n: facts() for n in "abc"}, skew=skew)
    assert [p for p in evaluate(INV, report.facts, report, CheckOptions(network=False)) if p.field == "clock"] == []


# ------------------------------------------------------------------------------------------------ reference host


def test_drift_is_found_when_the_master_is_unreachable_against_the_first_host_that_answered():
    from mnft.check.findings import reference_host

    outcomes = {"a": HostResult("a", Status.UNREACHABLE, error="no route"), "b": HostResult("b", Status.OK), "c": HostResult("c", Status.OK)}
    data = {"b": facts(), "c": facts(torch__version="2.12.0+cu124", nvidia__driver="535.1")}
    report = CheckReport(INV, outcomes, data)
    assert reference_host(INV, data) == "b"
    problems = evaluate(INV, data, report, CheckOptions(network=False))
    assert fields_of(problems) == [("c", "driver"), ("c", "torch")]
    assert problems[0].field == "torch" and problems[0].message == "torch 2.12.0+cu124 differs from b's (the first host that answered; the master a did not) 2.13.0+cu124"
    assert report.to_json()["reference"] == "b"


def test_the_master_is_the_reference_when_it_answered():
    from mnft.check.findings import reference_host

    assert reference_host(INV, {"c": facts(), "a": facts()}) == "a"
    assert reference_host(INV, {}) is None


def test_a_probes_skew_is_read_from_its_clock_and_own_run_time_and_is_none_without_a_clock():
    from mnft.check.rules import clock_skew, probe_skew

    facts = {"clock": 1005.0, "timings": {"total_s": 0.4}}
    assert probe_skew(facts, 1000.0, 1001.0) == clock_skew(1005.0, 1000.0, 1001.0, 0.4) == 4.3
    assert probe_skew({"clock": 1005.0}, 1000.0, 1001.0) == 4.5  # no run time: the round-trip's middle
    assert probe_skew({"clock": "soon"}, 1000.0, 1001.0) is None and probe_skew({}, 1000.0, 1001.0) is None


PROVISIONED = inventory.parse("vars: {slots: 2}\nhosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n")


def provisioned(inv):
    """The inventory as check sees it once `mnft provision` recorded an environment on every host (env.record.effective)."""
    from dataclasses import replace

    return replace(inv, hosts=tuple(replace(h, python="/root/mnft-env/bin/python", base_python="/usr/bin/python3", venv="~/mnft-env") for h in inv.hosts))


def test_a_check_where_every_host_failed_never_exits_0_and_each_host_gets_its_fix(capsys):
    """The hosts lost the recorded environment: every probe ends `exit code 127: sh: 1: /root/mnft-env/bin/python:
    not found`. Was: a row per host saying so, no fix line, exit 0."""
    from mnft.check.report import print_check
    from mnft.check.rules import probe_failed

    inv = provisioned(PROVISIONED)
    error = "exit code 127: sh: 1: /root/mnft-env/bin/python: not found"
    outcomes = {h.name: HostResult(h.name, Status.FAILED, exit_code=127, error=error) for h in inv.hosts}
    bare = CheckReport(inv, outcomes, {})
    assert bare.exit_code() == ExitCode.FAILED  # even with no problem listed: a host that did not pass
    report = CheckReport(inv, outcomes, {}, problems=[probe_failed(inv, o) for o in outcomes.values()])
    assert [(p.host, p.field, p.message) for p in report.problems] == [
        (n, "python", "/root/mnft-env/bin/python not found: the environment mnft provisioned here (~/mnft-env) is gone") for n in ("a", "b")]
    assert all("mnft provision" in p.fix for p in report.problems)
    assert report.exit_code() == ExitCode.FAILED
    print_check(report, False)
    out = capsys.readouterr().out
    assert out.count("fix: build it again, then mnft provision") == 2 and "every host can join" not in out


def test_a_probe_that_failed_otherwise_names_its_python_and_its_error():
    from mnft.check.rules import probe_failed

    not_found = probe_failed(INV, HostResult("a", Status.FAILED, exit_code=127, error="exit code 127: sh: 1: python3: not found"))
    assert (not_found.field, not_found.fix) == ("python", "install that Python on the host, or set 'python' for this host in the inventory")
    other = probe_failed(INV, HostResult("b", Status.FAILED, exit_code=1, error="exit code 1: SyntaxError"))
    assert other.field == "probe" and "SyntaxError" in other.message and other.severity == "error"


def test_missing_or_different_torch_on_provisioned_hosts_is_fixed_by_provision_not_pip():
    inv = provisioned(PROVISIONED)
    no_torch = facts(torch={"version": None, "cuda": None, "location": None})
    all_facts = {"a": facts(), "b": no_torch}
    problems = evaluate(inv, all_facts, CheckReport(inv, {h.name: HostResult(h.name, Status.OK) for h in inv.hosts}, all_facts), CheckOptions(network=False))
    torch = next(p for p in problems if p.field == "torch")
    assert "mnft provision" in torch.fix and "pip install" not in torch.fix
    all_facts = {"a": facts(), "b": facts(torch__version="2.12.0+cu124")}
    problems = evaluate(inv, all_facts, CheckReport(inv, {h.name: HostResult(h.name, Status.OK) for h in inv.hosts}, all_facts), CheckOptions(network=False))
    torch = next(p for p in problems if p.field == "torch")
    assert "mnft provision" in torch.fix and "pip install" not in torch.fix


def test_a_cpu_only_torch_on_a_host_with_gpus_is_a_problem_named_with_its_fix_unless_the_host_is_meant_for_the_cpu():
    """Was: `2.13.0+cpu`, cuda "-", on hosts with GPUs, and no word; then a warning, because the test bed's stand-in
    GPUs run CPU torch (issue 44: the product does not bend to its test bed). A host meant to train on its CPUs says
    so in the inventory (`device: cpu`: the test bed's inventories do)."""
    cpu = facts(torch={"version": "2.13.0+cpu", "cuda": None, "location": "/x"})
    problems = run({"a": cpu, "b": cpu, "c": cpu})
    found = [p for p in problems if p.field == "cuda"]
    assert [(p.host, p.severity) for p in found] == [("a", "error"), ("b", "error"), ("c", "error")]
    assert found[0].message == "torch 2.13.0+cpu is a CPU-only build: it cannot use this host's 2 GPU(s)"
    assert "CUDA build of torch 2.13.0" in found[0].fix and "CUDA 12.4" in found[0].fix and "`device: cpu`" in found[0].fix
    meant = inventory.parse("vars: {slots: 2}\nhosts:\n  a: {address: 10.0.0.1, device: cpu}\n  b: {address: 10.0.0.2}\n")
    report = CheckReport(meant, {h.name: HostResult(h.name, Status.OK) for h in meant.hosts}, {"a": cpu, "b": cpu})
    assert [p.host for p in evaluate(meant, {"a": cpu, "b": cpu}, report, CheckOptions(network=False)) if p.field == "cuda"] == ["b"]
    inv = provisioned(PROVISIONED)
    report = CheckReport(inv, {h.name: HostResult(h.name, Status.OK) for h in inv.hosts}, {"a": cpu, "b": cpu})
    assert all("mnft provision" in p.fix for p in evaluate(inv, {"a": cpu, "b": cpu}, report, CheckOptions(network=False)) if p.field == "cuda")
    no_gpus = facts(torch={"version": "2.13.0+cpu", "cuda": None, "location": "/x"}, nvidia=None)
    assert [p for p in run({"a": no_gpus, "b": no_gpus, "c": no_gpus}) if p.field == "cuda"] == []  # a CPU host: nothing to say
