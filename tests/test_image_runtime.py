"""A job in a container image: each runtime's command line, and each host's torchrun command wrapped in it.

Pure: a host's runtime facts and the launch plan in, argv out (mnft.image.runtime, mnft.run.launch.in_image)."""

from __future__ import annotations

import pytest

from mnft.core.errors import InputError
from mnft.hosts import inventory
from mnft.hosts.settings import Inventory
from mnft.image import runtime
from mnft.image.runtime import Container, Runtime
from mnft.run import launch
from mnft.run.job import Job, recipe_job

PODMAN = Runtime(kind="podman", path="/usr/bin/podman", uid=1000, gid=1000, home="/home/ada")
DOCKER = Runtime(kind="docker", path="/usr/bin/docker", uid=1000, gid=1000, home="/home/ada")
APPTAINER = Runtime(kind="apptainer", path="/usr/bin/apptainer", uid=1000, gid=1000, home="/home/ada")


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_podman_shares_the_hosts_network_and_ipc_runs_as_the_user_never_pulls_and_is_named():
    argv = runtime.run_argv(PODMAN, Container(image="localhost/lab:1", name="mnft-r1-h1", mounts=("~/mnft",), workdir="~/mnft"),
                            ["python3", "-m", "torch.distributed.run"])
    assert argv[:3] == ["/usr/bin/podman", "run", "--rm"]
    assert flag_values(argv, "--name") == ["mnft-r1-h1"]
    assert flag_values(argv, "--network") == ["host"] and flag_values(argv, "--ipc") == ["host"]
    assert flag_values(argv, "--user") == ["1000:1000"] and flag_values(argv, "--pull") == ["never"]
    assert flag_values(argv, "-v") == ["/home/ada/mnft:/home/ada/mnft"]
    assert flag_values(argv, "--workdir") == ["/home/ada/mnft"]
    assert argv[-4:] == ["localhost/lab:1", "python3", "-m", "torch.distributed.run"]


def test_rootless_podman_maps_the_user_in_instead_of_naming_a_uid():
    argv = runtime.run_argv(Runtime(**{**PODMAN.__dict__, "rootless": True}), Container(image="x", name="n"), ["true"])
    assert flag_values(argv, "--userns") == ["keep-id"] and "--user" not in argv


def test_environment_goes_by_name_only():
    argv = runtime.run_argv(PODMAN, Container(image="x", name="n", env_names=("NCCL_SOCKET_IFNAME", "MNFT_RUN_TAG")), ["true"])
    assert flag_values(argv, "-e") == ["NCCL_SOCKET_IFNAME", "MNFT_RUN_TAG"]
    assert not any("=" in value for value in flag_values(argv, "-e"))


def test_the_container_sees_exactly_the_gpus_the_run_holds():
    gpu_host = Runtime(**{**PODMAN.__dict__, "gpus": True, "cdi": True})
    argv = runtime.run_argv(gpu_host, Container(image="x", name="n", devices=(2, 3)), ["true"])
    assert flag_values(argv, "--device") == ["nvidia.com/gpu=2", "nvidia.com/gpu=3"]
    assert flag_values(runtime.run_argv(gpu_host, Container(image="x", name="n"), ["true"]), "--device") == ["nvidia.com/gpu=all"]
    docker = runtime.run_argv(Runtime(**{**DOCKER.__dict__, "gpus": True}), Container(image="x", name="n", devices=(1, 5)), ["true"])
    assert flag_values(docker, "--gpus") == ['"device=1,5"']
    # inside podman/docker the held GPUs are numbered from 0; apptainer's --nv shows every GPU under the host's numbers
    assert runtime.visible_devices(gpu_host, (2, 3)) == "0,1"
    assert runtime.visible_devices(APPTAINER, (2, 3)) == "2,3"
    assert runtime.visible_devices(gpu_host, None) is None


def test_podman_on_a_gpu_host_without_cdi_is_refused_with_the_fix():
    with pytest.raises(InputError, match="nvidia-ctk cdi generate"):
        runtime.run_argv(Runtime(**{**PODMAN.__dict__, "gpus": True}), Container(image="x", name="n", devices=(0,)), ["true"])


def test_a_host_without_gpus_gets_no_device_flags():
    argv = runtime.run_argv(PODMAN, Container(image="x", name="n", devices=None), ["true"])
    assert "--device" not in argv and "--gpus" not in argv


def test_apptainer_binds_and_needs_no_network_user_or_removal():
    argv = runtime.run_argv(Runtime(**{**APPTAINER.__dict__, "gpus": True}),
                            Container(image="/shared/lab.sif", name="n", mounts=("/data", "~/mnft"), workdir="~/mnft"), ["python3"])
    assert argv[:2] == ["/usr/bin/apptainer", "exec"]
    assert flag_values(argv, "--bind") == ["/data:/data", "/home/ada/mnft:/home/ada/mnft"]
    assert "--nv" in argv and "--network" not in argv and "--user" not in argv
    assert argv[-2:] == ["/shared/lab.sif", "python3"]
    assert runtime.teardown_argv("apptainer", "/usr/bin/apptainer", "n") is None


def test_teardown_removes_the_container_by_its_name():
    assert runtime.teardown_argv("podman", "/usr/bin/podman", "mnft-r-h1", grace=3) == ["/usr/bin/podman", "rm", "--force", "--time", "3", "mnft-r-h1"]
    assert runtime.teardown_argv("docker", "/usr/bin/docker", "mnft-r-h1") == ["/usr/bin/docker", "rm", "--force", "mnft-r-h1"]


def test_mounts_are_absolute_once_each_and_never_split_by_the_runtime():
    assert runtime.mounts(("~/mnft", "~/mnft/outputs/j", "~/mnft-data", "/data/x"), "/home/ada") == \
        ("/data/x", "/home/ada/mnft", "/home/ada/mnft-data")
    for bad in ("/data/a:b", "/data/a,b", "/data/a b"):
        with pytest.raises(InputError, match="cannot be mounted"):
            runtime.mounts((bad,), "/home/ada")


def test_container_names_keep_to_the_runtimes_alphabet():
    assert runtime.container_name("20261127-120000-ab12", "gpu-01.lab") == "mnft-20261127-120000-ab12-gpu-01.lab"
    assert runtime.container_name("r", "h@1") == "mnft-r-h_1"


@pytest.mark.parametrize("ref", ["", "-v", "--privileged", "a b", "a;b", "x" * 600, "$(id)"])
def test_an_image_reference_that_is_not_one_word_is_refused_in_one_line(ref):
    with pytest.raises(InputError) as error:
        runtime.check_ref(ref, "--image")
    assert "--image" in str(error.value) and "\n" not in str(error.value)


def two_hosts() -> Inventory:
    return inventory.parse("vars: {slots: 2}\nhosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n")


def plan(job: Job, runtimes=None, secret_names=(), visible=None):
    return launch.plan(two_hosts(), master_addr="10.0.0.1", port=29500, run_id="r1", job_id="r1", options=launch.LaunchOptions(job=job),
                       ifaces={"h1": "eth0", "h2": "eth0"}, env={"WANDB_PROJECT": "x"}, secret_names=secret_names,
                       runtimes=runtimes, visible=visible)


def test_each_hosts_torchrun_runs_in_the_image_with_the_images_python():
    runtimes = {"h1": PODMAN, "h2": PODMAN}
    plans = plan(Job(entry=("train.py",), image="localhost/lab:1"), runtimes)
    for p in plans:
        argv = list(p.argv)
        image_at = argv.index("localhost/lab:1")
        assert argv[0] == "/usr/bin/podman" and argv[image_at + 1:image_at + 4] == ["python3", "-m", "torch.distributed.run"]
        assert flag_values(argv, "--name") == [f"mnft-r1-{p.host}"]
        assert "/home/ada/mnft:/home/ada/mnft" in flag_values(argv, "-v")
        assert "/home/ada/mnft-data:/home/ada/mnft-data" in flag_values(argv, "-v")
        names = flag_values(argv, "-e")
        assert {"NCCL_SOCKET_IFNAME", "WANDB_PROJECT", "PYTHONPATH", "MNFT_RUN_TAG", "MNFT_RUN_ID"} <= set(names)
        assert "HOME" not in names  # the host's home is not mounted: the image's HOME stays writable
        assert p.env["NCCL_SOCKET_IFNAME"] == "eth0"  # the value: in the keeper's environment, which the client passes in
        assert p.container["name"] == f"mnft-r1-{p.host}" and p.container["teardown"][-1] == f"mnft-r1-{p.host}"
        assert p.container["image"] == "localhost/lab:1"
        assert p.spec("r1", {}, launch.LaunchOptions())["container"] == p.container


def test_a_restarted_attempt_gets_a_container_of_its_own():
    first = plan(Job(entry=("train.py",), image="x"), {"h1": PODMAN, "h2": PODMAN})
    again = launch.plan(two_hosts(), master_addr="10.0.0.1", port=29500, run_id="r1", job_id="r1", options=launch.LaunchOptions(job=Job(entry=("train.py",), image="x")),
                        ifaces={}, env={}, secret_names=(), runtimes={"h1": PODMAN, "h2": PODMAN}, attempt=2)
    assert first[0].container["name"] == "mnft-r1-h1" and again[0].container["name"] == "mnft-r1-a2-h1"


def test_secrets_reach_the_container_through_the_run_directorys_file_never_by_name_or_value():
    plans = plan(Job(entry=("train.py",), image="x"), {"h1": PODMAN, "h2": PODMAN}, secret_names=("HF_TOKEN",))
    argv = list(plans[0].argv)
    assert "HF_TOKEN" not in flag_values(argv, "-e") and not any("HF_TOKEN" in a for a in argv)
    image_at = argv.index("x")
    run_dir = "/home/ada/mnft/runs/r1/h1"
    assert argv[image_at + 1:image_at + 5] == ["python3", f"{run_dir}/entry.py", "--secrets", f"{run_dir}/secrets.json"]
    assert plans[0].container["secrets_file"] is True
    assert plans[0].spec("r1", {"HF_TOKEN": "hf_x"}, launch.LaunchOptions())["secrets"] == {"HF_TOKEN": "hf_x"}  # by stdin, as always


def test_the_held_gpus_are_the_containers_numbered_from_zero():
    gpu_host = Runtime(**{**PODMAN.__dict__, "gpus": True, "cdi": True})
    plans = plan(Job(entry=("train.py",), image="x"), {"h1": gpu_host, "h2": gpu_host}, visible={"h1": (2, 3), "h2": (0, 1)})
    assert flag_values(list(plans[0].argv), "--device") == ["nvidia.com/gpu=2", "nvidia.com/gpu=3"]
    assert plans[0].env["CUDA_VISIBLE_DEVICES"] == "0,1" and "CUDA_DEVICE_ORDER" not in plans[0].env
    assert plans[0].devices == (2, 3)  # the run's record and leases keep the host's numbers


def test_a_host_without_a_runtime_is_refused_naming_it():
    with pytest.raises(InputError, match="h2: the job runs in the image x but no container runtime"):
        plan(Job(entry=("train.py",), image="x"), {"h1": PODMAN})


def test_without_an_image_nothing_changes():
    plans = plan(recipe_job("lora"), {"h1": PODMAN, "h2": PODMAN})
    assert plans[0].argv[0] == "python3" and plans[0].container is None


def test_podman_runs_the_image_by_the_id_the_check_verified_so_a_retag_cannot_swap_it():
    facts = {"runtime": "podman", "path": "/usr/bin/podman", "uid": 0, "gid": 0, "home": "/root",
             "image": {"ref": "localhost/lab:1", "present": True, "id": "sha256:" + "ab" * 32}}
    rt = Runtime.from_facts(facts)
    plans = plan(Job(entry=("train.py",), image="localhost/lab:1"), {"h1": rt, "h2": rt})
    argv = list(plans[0].argv)
    assert "ab" * 32 in argv and "localhost/lab:1" not in argv
    assert plans[0].container["image"] == "localhost/lab:1" and plans[0].container["image_id"] == "sha256:" + "ab" * 32
    sif = Runtime.from_facts({**facts, "runtime": "apptainer", "image": {"ref": "~/lab.sif", "present": True, "id": "sha256:" + "cd" * 32}})
    assert sif.runs("~/lab.sif") == "/root/lab.sif"  # a .sif runs from its path
