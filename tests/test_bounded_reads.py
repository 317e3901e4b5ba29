"""Every read mnft makes, listed with its bound (issue 30: "bounded reads everywhere input is read").

`READS` is the table: for each call in mnft/ that reads a file, a pipe, a socket or an archive (found by scanning
the source: `open`, `read*`, `readline`, `recv`, `json.load`, `tarfile`, `zipfile`, TensorBoard's reader, a
program's captured output …), what it reads and what bounds it:

* a limit of `mnft.core.limits` (its name: the docs' "Limits of input" table has it);
* `host: …` a host-side script's own cap (they import nothing from mnft: docs/architecture.md);
* `none: …` why no bound is needed (mnft's own source, /proc, the controller's own stdin on a host …);
* `owner: …` a read in a file another part of the project owns, with the fix to apply there.

A new read that is not in the table fails `test_every_read_in_mnft_is_in_the_table_with_its_bound`, and so does
a row whose read is gone. The rest of the file feeds each limit added for this one byte past it (or a host, a
line past it) and sees the one-line refusal.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import struct
import tarfile
import zipfile
from pathlib import Path

import pytest

from mnft.core import limits
from mnft.core.errors import InputError

REPO = Path(__file__).resolve().parent.parent
MNFT = REPO / "mnft"

H = "HOST_OUTPUT_BYTES"  # a host's reply: kept within it as it is read (mnft.hosts.connection.Process)
OWN = "none: mnft's own source file, read to ship it to a host"
PROC = "none: a /proc file the kernel writes, of a size the kernel bounds"
STDIN = "none: the controller's own request on the host script's stdin (the controller is trusted by the host)"
CHUNKS = "none: read in fixed chunks to hash or stream it, never held whole"
TOOL = f"none: a system tool's answer about the host, bounded by what the host has; it reaches the controller within {H}"
JOB = "none: the recipe runs on the host as the job, and reads the job's own files (its trust, its memory)"

READS: dict[tuple[str, str, str], tuple[str, str]] = {
    # ---------------------------------------------------------------- the controller, through mnft.core's readers
    ("core/yamlfile.py", "read_text", "limits.read_bytes"): ("an inventory, job file, playbook or recipe config (size, line length)", "JOB_BYTES"),
    ("hosts/inventory.py", "load", "yamlfile.read_text"): ("an inventory", "INVENTORY_BYTES"),
    ("run/job.py", "load_job_file", "yamlfile.read_text"): ("a job file", "JOB_BYTES"),
    ("setup/playbook.py", "load", "yamlfile.read_text"): ("a setup playbook", "JOB_BYTES"),
    ("recipes/config.py", "load_config", "yamlfile.read_text"): ("a recipe's config file (config=PATH), on the controller and the hosts", "JOB_BYTES"),
    ("env/lockfile.py", "load", "limits.read_bytes"): ("requirements.lock, pylock.toml", "LOCK_BYTES"),
    ("hosts/hostkeys.py", "TrustedKeys.read", "limits.read_bytes"): ("a known_hosts file", "KNOWN_HOSTS_BYTES"),
    ("setup/steps/authorized_keys.py", "prepare", "limits.read_bytes"): ("the controller's public key setup installs", "PUBLIC_KEY_BYTES"),
    ("setup/steps/mesh.py", "local_host_keys", "limits.read_file"): ("this machine's /etc/ssh/ssh_host_*_key.pub (a local host's keys)", "PUBLIC_KEY_BYTES"),
    ("run/records.py", "read_record", "limits.read_at_most"): ("runs/<id>/run.json", "RECORD_BYTES"),
    ("run/records.py", "stop_requested", "limits.read_json"): ("runs/<id>/stop-requested", "STATE_BYTES"),
    ("run/control.py", "supervisor", "limits.read_json"): ("runs/<id>/live.json", "STATE_BYTES"),
    ("run/logs.py", "_times", "limits.read_file"): ("runs/<id>/step-times.jsonl, live-metrics.jsonl (read_step_times)", "STATE_BYTES"),
    ("run/logs.py", "collected_states", "limits.read_file"): ("a collected stopped_by mark", "RUN_VALUE_BYTES"),
    ("run/logs.py", "teardown_note", "limits.last_lines"): ("each host's output.log: its last TEARDOWN_LINES only", "LINE_CHARS"),
    ("env/record.py", "load_state", "limits.read_json"): ("$MNFT_HOME/provision/hosts.json", "STATE_BYTES"),
    ("env/wheelhouse.py", "Wheelhouse._load_index", "limits.read_json"): ("the wheelhouse's .index.json", "STATE_BYTES"),
    ("env/wheelhouse.py", "_wheel_metadata", "limits.read_at_most"): ("a wheel's METADATA", "WHEEL_METADATA_BYTES"),
    ("run/logs.py", "_value", "limits.read_file"): ("a collected exit_code, ended", "RUN_VALUE_BYTES"),
    ("run/logs.py", "_listing", "limits.read_file"): ("the names of a job's checkpoints directory `logs` kept (at most queries.CHECKPOINT_NAMES)", "STATE_BYTES"),
    ("run/logs.py", "_metrics_in", "limits.lines"): ("the job's collected metrics files, line by line (cut at METRIC_WIDTH)", "COLLECTED_BYTES"),
    ("run/logs.py", "rank0_output_records", "limits.lines"): ("a host's collected output.log, line by line (cut at METRIC_WIDTH)", "COLLECTED_BYTES"),
    ("run/logs.py", "rank_timings", "limits.lines"): ("the ranks' collected step timings, line by line", "COLLECTED_BYTES"),
    ("run/logs.py", "merged_tail", "limits.last_lines"): ("each host's output.log: its end only", "LINE_CHARS"),
    ("run/sweeper.py", "Sweeper.reap", "limits.last_lines"): ("a point's own log, when its train ended unrecorded: its last 3 lines", "LINE_CHARS"),
    ("run/needs.py", "job_needs", "limits.read_file"): ("the job's source files, for their imports (a larger one is not followed)", "SOURCE_BYTES"),
    ("run/scrape.py", "read_json", "limits.read_at_most"): ("trainer_state.json", "METRICS_FILE_BYTES"),
    ("sync/gitignore.py", "_ignore_files.read", "limits.read_file"): (".gitignore, .git/info/exclude, core.excludesFile", "IGNORE_FILE_BYTES"),
    ("sync/rsync.py", "_read_messages", "limits.read_at_most"): ("rsync's stderr: the part kept", H),
    # ---------------------------------------------------------------- the controller
    ("check/gather.py", "_first_json_line", ".readline"): ("a listener's line on a host", H),
    ("core/yamlfile.py", "load", "yaml.load"): ("a YAML document already read within its limit", "YAML_NODES"),
    ("env/wheelhouse.py", "Wheelhouse._download", "subprocess.run"): ("pip download's output (about the lock's packages)", "none: the controller's own pip, its output proportional to the lock (LOCK_BYTES)"),
    ("env/wheelhouse.py", "_wheel_metadata", ".open"): ("a wheel's .dist-info/METADATA, its unpacked size checked first", "WHEEL_METADATA_BYTES"),
    ("env/wheelhouse.py", "_wheel_metadata", "zipfile.ZipFile"): ("a wheel's directory of members", "none: the wheel the lock names, by its sha256; its directory is proportional to its size"),
    ("hosts/connection.py", "Process.json_reply", ".readline"): ("a host script's reply line", H),
    ("hosts/connection.py", "_LocalProcess.__init__", ".read1"): ("a local host command's stdout and stderr", H),
    ("hosts/connection.py", "_LocalProcess.__init__", "subprocess.Popen"): ("a local host command's stdout and stderr", H),
    ("hosts/connection.py", "_channel_chunks", "recv"): ("an SSH host command's stdout and stderr", H),
    ("hosts/connection.py", "_answers_like_sshd", ".recv"): ("an sshd's first bytes", "none: recv(len(SSHD_DROP_LINE)), once"),
    ("hosts/connection.py", "_open_once", ".open"): ("(fabric's connection.open(), not a read)", "none: opens an SSH connection"),
    ("hosts/hostkeys.py", "load_trusted", ".read"): ("known_hosts files, through TrustedKeys.read", "KNOWN_HOSTS_BYTES"),
    ("perf/collectives.py", "_wait_ready", ".readline"): ("the all_reduce launcher's lines", H),
    ("perf/collectives.py", "start_allreduce", ".read_text"): ("mnft/perf/allreduce.py", OWN),
    ("perf/links.py", "_json_line", ".readline"): ("a link agent's lines", H),
    ("run/gang.py", "Gang._start_one", ".readline"): ("a run's agent events (then a stream that keeps nothing)", H),
    ("run/launch.py", "read_env_file", "open"): ("an --env-file, checked as opened (fstat)", "ENV_FILE_BYTES"),
    ("run/launch.py", "read_env_file", ".read"): ("an --env-file: read(ENV_FILE_MAX + 1)", "ENV_FILE_BYTES"),
    ("run/logs.py", "unpack", "tarfile.open"): ("a host's collected logs, counted from the tar headers before any is written", "COLLECTED_BYTES"),
    ("run/records.py", "read_record", "open"): ("runs/<id>/run.json, measured by fstat first", "RECORD_BYTES"),
    ("run/scrape.py", "read_json", "open"): ("trainer_state.json (a job's metrics file), measured by fstat first", "METRICS_FILE_BYTES"),
    ("run/scrape.py", "event_file_framing", "open"): ("a TensorBoard event file's record headers", "METRICS_FILE_BYTES"),
    ("run/scrape.py", "event_file_framing", ".read"): ("8 bytes: one record's length", "METRICS_FILE_BYTES"),
    ("run/scrape.py", "tensorboard", "EventAccumulator"): ("TensorBoard event files, each framed first (event_file_framing)", "METRICS_FILE_BYTES"),
    ("sync/gitignore.py", "git", "subprocess.run"): ("git's answers about the tree", "none: the controller's own git, its output proportional to the user's tree"),
    ("sync/gitignore.py", "git_view", "subprocess.run"): ("git init's output", "none: the controller's own git"),
    ("sync/rsync.py", "_read_messages", ".read"): ("rsync's stderr (ssh's and the remote rsync's messages): the first part kept, the rest counted", H),
    ("sync/rsync.py", "_run_rsync_once", "subprocess.Popen"): ("rsync's itemized stdout, line by line (its last 200 other lines kept), and its stderr (_read_messages)", H),
    ("sync/rsync.py", "ssh_accepts", "subprocess.run"): ("ssh -G's answer", "none: the controller's own ssh, a screenful"),
    ("run/notify.py", "run", ".read"): ("the end of the notify command's output", "none: its last OUTPUT_TAIL×4 bytes (2 KiB)"),
    ("sync/snapshot.py", "_copy", "subprocess.run"): ("rsync's stderr copying the tree into this machine's snapshot store (its last 300 characters shown)", "none: the controller's own rsync, its output a line per error"),
    # ---------------------------------------------------------------- the recipes: run by torchrun on the hosts as the job
    ("recipes/checkpointing.py", "complete_steps", ".read_text"): ("a checkpoint's marker", JOB),
    ("recipes/checkpointing.py", "held", ".read_text"): ("a checkpoint's marker", JOB),
    ("recipes/checkpointing.py", "load", ".read_text"): ("a checkpoint's state", JOB),
    ("recipes/checkpointing.py", "resolve", ".read_text"): ("a checkpoint's marker", JOB),
    ("recipes/config.py", "_coerce", "yaml.safe_load"): ("a list value of --set (one argument: the OS bounds it to 128 KiB) or the config",
                                                         "none: one argument; its aliases stay shared objects; nesting too deep is one line"),
    ("recipes/data.py", "read_jsonl", ".read_text"): ("the job's data set", JOB),
    ("recipes/metrics.py", "Metrics.__init__", "open"): ("(its own metrics file, appended)", JOB),
    ("recipes/model.py", "tiny_key", ".read_bytes"): ("the bundled tiny model's files", JOB),
    ("recipes/reshard.py", "MergedReader._merge", "open"): ("the job's checkpoint shards", JOB),
    ("recipes/reshard.py", "MergedReader._merge", "pickle.load"): ("the job's checkpoint shards", JOB),
    ("recipes/timing.py", "StepTimer.__init__", "open"): ("(its own timing file, appended)", JOB),
    # ---------------------------------------------------------------- host-side scripts (their own caps)
    ("onhost/superhost.py", "_read_json", "open"): ("a supervisor's own files (supervisor.json, exit.json, its run's run.json)", "host: RECORD_MAX (16 MiB)"),
    ("onhost/superhost.py", "_read_json", ".read"): ("a supervisor's own files (supervisor.json, exit.json, its run's run.json)", "host: RECORD_MAX (16 MiB)"),
    ("onhost/superhost.py", "state", "open"): ("a supervisor's console.log, from an offset", "host: READ_MAX (256 KiB) a call"),
    ("onhost/superhost.py", "state", ".read"): ("a supervisor's console.log, from an offset", "host: READ_MAX (256 KiB) a call"),
    ("onhost/superhost.py", "main", ".read"): ("a prepare's files, a start's spec, a reach's peers", STDIN),
    ("onhost/superhost.py", "unpack", "tarfile.open"): ("the supervisor's bundle, streamed from stdin", STDIN),
    ("onhost/superhost.py", "reach.one", "subprocess.run"): ("ssh's answer to `true`", "none: this host's own ssh, a line of error at most"),
    ("run/supervised.py", "main", ".read"): ("the supervisor's spec, through the pipe superhost gave it", STDIN),
    ("run/supervised.py", "point", ".read"): ("a sweep's point's spec, through the pipe its sweep's supervisor gave it", STDIN),
    ("run/sweepreport.py", "metrics_of", "limits.read_bytes"): ("a sweep's point's metrics (metrics.jsonl, live-metrics.jsonl)", "METRICS_FILE_BYTES"),
    ("run/bundle.py", "build", ".open"): ("this controller's installed library files, into the bundle", "none: the controller's own installed files"),
    ("run/bundle.py", "build", ".read_bytes"): ("this controller's installed library files, hashed", "none: the controller's own installed files"),
    ("run/bundle.py", "build", "tarfile.open"): ("the bundle being written (gzip)", "none: written here, never read"),
    ("run/bundle.py", "dists", ".read_text"): ("an installed distribution's WHEEL file (its tags)", "none: the controller's own installed files"),
    ("run/bundle.py", "_read_stamp", "limits.read_json"): ("the bundle's stamp", "STATE_BYTES"),
    ("run/bundle.py", "contents", "limits.read_bytes"): ("the bundle, sent to a host", "BUNDLE_BYTES"),
    ("run/supervisor.py", "_known_lines", "limits.read_bytes"): ("a known_hosts file (the lines of the run's hosts)", "KNOWN_HOSTS_BYTES"),
    ("run/supervisor.py", "hand_off", "limits.read_file"): ("$MNFT_HOME/provision/hosts.json", "STATE_BYTES"),
    ("run/supervisor.py", "_pull", "subprocess.run"): ("rsync's answer pulling the supervisor's record", "none: the controller's own rsync, its output a line per error"),
    ("onhost/facts.py", "_os_release", "open"): ("/etc/os-release", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_os_release", ".read"): ("/etc/os-release", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_assignments", "open"): ("torch's version.py", "host: SOURCE_CHARS (1 MiB), larger: an error of the probe"),
    ("onhost/facts.py", "_assignments", ".read"): ("torch's version.py", "host: SOURCE_CHARS (1 MiB), larger: an error of the probe"),
    ("onhost/facts.py", "_dist_version", "open"): ("a distribution's METADATA headers", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_dist_version", ".read"): ("a distribution's METADATA headers", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_distributions", "open"): ("each distribution's METADATA headers", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_distributions", ".readline"): ("each distribution's METADATA headers, line by line", "host: HEADER_CHARS (64 KiB)"),
    ("onhost/facts.py", "_memory", "open"): ("/proc/meminfo", PROC),
    ("onhost/nettest.py", "_drain", ".recv"): ("a connection to the listen test", "host: recv(4096), only to see it close"),
    ("onhost/nettest.py", "connect", ".recv"): ("the listener's reply", "host: 64 bytes at most"),
    ("onhost/nettest.py", "_stdin_is_a_channel", "os.read"): ("the controller's channel", STDIN),
    ("onhost/nettest.py", "_serve", "os.read"): ("the controller's channel (its end), or a session's stop pipe (its end)", STDIN),
    ("onhost/facts.py", "_spawn", "subprocess.Popen"): ("nvidia-smi, ip, ethtool … (with a deadline)", TOOL),
    ("onhost/probe.py", "_request", ".readline"): ("the controller's request (check --image: imagehost's source, the probe's command inside the image; a session: "
                                                  "a script to run, listen, connect)", "host: REQUEST_BYTES (16 MiB), larger: an error of the probe"),
    ("onhost/probe.py", "_end", ".read"): ("the end of a command's output the controller sent (the probe inside the image)", "host: STDOUT_KEPT (4 MiB), STDERR_KEPT (64 KiB)"),
    ("onhost/envfacts.py", "_read_json", "open"): ("an environment's record (its distributions)", "host: RECORD_BYTES (16 MiB), larger: no record"),
    ("onhost/envfacts.py", "_read_json", ".read"): ("an environment's record (its distributions)", "host: RECORD_BYTES (16 MiB), larger: no record"),
    ("onhost/envfacts.py", "env_python_version", "open"): ("pyvenv.cfg", "host: TEXT_BYTES (64 KiB)"),
    ("onhost/envfacts.py", "env_python_version", ".read"): ("pyvenv.cfg", "host: TEXT_BYTES (64 KiB)"),
    ("onhost/envfacts.py", "_os_release", "open"): ("/etc/os-release", "host: TEXT_BYTES (64 KiB)"),
    ("onhost/envfacts.py", "_os_release", ".read"): ("/etc/os-release", "host: TEXT_BYTES (64 KiB)"),
    ("onhost/meshpeers.py", "mesh_peers", "open"): ("~/.ssh/config's mesh block", "host: CONFIG_BYTES (4 MiB, as setup's HOST_FILE_BYTES), larger: no mesh"),
    ("onhost/meshpeers.py", "mesh_peers", ".read"): ("~/.ssh/config's mesh block", "host: CONFIG_BYTES (4 MiB, as setup's HOST_FILE_BYTES), larger: no mesh"),
    ("onhost/envhost.py", "_run", ".read"): ("the installer's output, for its error", "host: OUTPUT_KEPT (its last 64 KiB)"),
    ("onhost/envhost.py", "_controller_gone", "os.read"): ("the controller's heartbeats, dropped", STDIN),
    ("onhost/envhost.py", "main", ".readline"): ("the install spec", STDIN),
    ("onhost/envfacts.py", "_libc", "subprocess.run"): ("ldd --version", TOOL),
    ("onhost/imagehost.py", "_kept", ".read"): ("a runtime's output (podman/docker/apptainer, nvidia-smi), from a temporary file: its end", "host: OUTPUT_KEPT (64 KiB)"),
    ("onhost/imagehost.py", "cdi_gpus", "open"): ("a CDI spec in /etc/cdi, /var/run/cdi", "host: CDI_BYTES (1 MiB) each, CDI_FILES (64) files"),
    ("onhost/imagehost.py", "cdi_gpus", ".read"): ("a CDI spec in /etc/cdi, /var/run/cdi", "host: CDI_BYTES (1 MiB) each, CDI_FILES (64) files"),
    ("onhost/imagehost.py", "_load_cache", "open"): ("~/.cache/mnft/sif-ids.json", "host: CACHE_BYTES (1 MiB), larger: started afresh"),
    ("onhost/imagehost.py", "_load_cache", ".read"): ("~/.cache/mnft/sif-ids.json", "host: CACHE_BYTES (1 MiB), larger: started afresh"),
    ("onhost/envfacts.py", "_python_version", "subprocess.run"): ("a Python's version", TOOL),
    ("onhost/linkagent.py", "_recv_exact", ".recv"): ("n bytes the caller asks for (one)", "host: n bytes"),
    ("onhost/linkagent.py", "_serve_one", ".recv"): ("echo: 64 bytes at a time, sent back", CHUNKS),
    ("onhost/linkagent.py", "measure", ".makefile"): ("a peer's reply line", "host: REPLY_BYTES (64 KiB)"),
    ("onhost/linkagent.py", "measure", ".readline"): ("a peer's reply line", "host: REPLY_BYTES (64 KiB)"),
    ("onhost/linkagent.py", "serve", "os.read"): ("the controller's commands", STDIN),
    ("onhost/torchlaunch.py", "_read_payload", ".readline"): ("the controller's payload", STDIN),
    ("onhost/torchlaunch.py", "_read_payload", ".read"): ("the controller's payload", STDIN),
    ("onhost/runfiles.py", "_read", "open"): ("a run directory's file (spec.json, pgid, exit_code …)", "host: RUN_FILE_BYTES (64 MiB), larger: as missing"),
    ("onhost/runfiles.py", "_read", ".read"): ("a run directory's file (spec.json, pgid, exit_code …)", "host: RUN_FILE_BYTES (64 MiB), larger: as missing"),
    ("onhost/runprocs.py", "_environ_has", "open"): ("/proc/<pid>/environ", PROC),
    ("onhost/runprocs.py", "_environ_has", ".read"): ("/proc/<pid>/environ", PROC),
    ("onhost/runprocs.py", "run_pids", "open"): ("/proc/<pid>/stat", PROC),
    ("onhost/runprocs.py", "run_pids", ".read"): ("/proc/<pid>/stat", PROC),
    ("onhost/runprocs.py", "_stat", "open"): ("/proc/<pid>/stat", PROC),
    ("onhost/runprocs.py", "_stat", ".read"): ("/proc/<pid>/stat", PROC),
    ("onhost/runprocs.py", "_cmdline", "open"): ("/proc/<pid>/cmdline", PROC),
    ("onhost/runprocs.py", "_cmdline", ".read"): ("/proc/<pid>/cmdline", PROC),
    ("onhost/samples.py", "_cpu_times", "open"): ("/proc/stat", PROC),
    ("onhost/samples.py", "_cpu_times", ".readline"): ("/proc/stat", PROC),
    ("onhost/samples.py", "_process_ticks", "open"): ("/proc/<pid>/stat", PROC),
    ("onhost/samples.py", "_process_ticks", ".read"): ("/proc/<pid>/stat", PROC),
    ("onhost/keeper.py", "keep", "open"): ("secrets.json: the agent's own 0600 file from the controller's spec", STDIN),
    ("onhost/keeper.py", "keep", "json.load"): ("secrets.json: the agent's own 0600 file from the controller's spec", STDIN),
    ("onhost/follow.py", "_Tail.lines", "open"): ("output.log, as the job writes it", "host: TAIL_CHUNK (4 MiB) a poll, a line cut at 64 KiB"),
    ("onhost/follow.py", "_Tail.lines", ".read"): ("output.log, as the job writes it", "host: TAIL_CHUNK (4 MiB) a poll, a line cut at 64 KiB"),
    ("onhost/queries.py", "_last_lines", "open"): ("output.log's end", "host: 256 KiB"),
    ("onhost/queries.py", "_last_lines", ".read"): ("output.log's end", "host: 256 KiB"),
    ("onhost/queries.py", "_small_json", "open"): ("a checkpoint's small JSON", "host: 64 KiB, measured first"),
    ("onhost/queries.py", "_small_json", "json.load"): ("a checkpoint's small JSON", "host: 64 KiB, measured first"),
    ("onhost/runleases.py", "lease_fd", "os.pread"): ("a lease file anyone may plant", "host: 64 KiB"),
    ("onhost/launcher.py", "launch", ".readline"): ("the launch spec", STDIN),
    ("onhost/launcher.py", "supervise", "os.read"): ("the controller's heartbeats", STDIN),
    ("onhost/queries.py", "tail", "os.read"): ("the controller's channel (its end)", STDIN),
    ("onhost/queries.py", "pack", "tarfile.open"): ("(writes the pack: the run directory, extras within PACK_EXTRA_BYTES)", "none: the controller bounds what it unpacks: COLLECTED_BYTES"),
    ("onhost/rungpus.py", "gpu_apps", "subprocess.run"): ("nvidia-smi", TOOL),
    ("onhost/containers.py", "remove_container", "subprocess.run"): ("the container runtime's answer to rm (its last 4 KiB of stderr looked at)", TOOL),
    ("onhost/entry.py", "exec_with_secrets", "open"): ("the run's secrets file, written by its own agent", "host: SECRETS_BYTES (1 MiB)"),
    ("onhost/entry.py", "exec_with_secrets", ".read"): ("the run's secrets file, written by its own agent", "host: SECRETS_BYTES (1 MiB)"),
    ("onhost/rungpus.py", "gpu_util", "subprocess.run"): ("nvidia-smi", TOOL),
    ("onhost/setuphost.py", "op_read", "open"): ("authorized_keys, known_hosts, ~/.ssh/config, /etc/hosts", "HOST_FILE_BYTES"),
    ("onhost/setuphost.py", "op_read", ".read"): ("authorized_keys, known_hosts, ~/.ssh/config, /etc/hosts", "HOST_FILE_BYTES"),
    ("onhost/setuphost.py", "op_write", "open"): ("(a file rewritten in place, r+b: its content is written, not read)", "none: a write"),
    ("onhost/setuphost.py", "_current_sha", "open"): ("a file's hash before it is replaced", CHUNKS),
    ("onhost/setuphost.py", "_current_sha", ".read"): ("a file's hash before it is replaced", CHUNKS),
    ("onhost/setuphost.py", "_record_kind", "open"): ("the key's .mnft-generated record", "host: 64 KiB"),
    ("onhost/setuphost.py", "_record_kind", ".read"): ("the key's .mnft-generated record", "host: 64 KiB"),
    ("onhost/setuphost.py", "op_keygen", "open"): ("the mesh key's .pub", "host: PUBLIC_KEY_CHARS (64 KiB, as PUBLIC_KEY_BYTES), larger: an error"),
    ("onhost/setuphost.py", "op_keygen", ".read"): ("the mesh key's .pub", "host: PUBLIC_KEY_CHARS (64 KiB, as PUBLIC_KEY_BYTES), larger: an error"),
    ("onhost/setuphost.py", "op_keygen", "subprocess.run"): ("ssh-keygen", TOOL),
    ("onhost/setuphost.py", "_sleeper_is_ours", "open"): ("/proc/<pid>/cmdline", PROC),
    ("onhost/setuphost.py", "_sleeper_is_ours", ".read"): ("/proc/<pid>/cmdline", PROC),
    ("onhost/setuphost.py", "main", ".readline"): ("the controller's ops", STDIN),
    ("onhost/setuphost.py", "op_addresses", "subprocess.run"): ("ip -j addr", TOOL),
    ("onhost/setuphost.py", "op_nft_guarded", "subprocess.run"): ("nft -c / nft -f", TOOL),
    ("onhost/setuphost.py", "op_run", "subprocess.run"): ("the commands setup's steps run (nft list, ufw status, sudo -n true …)", TOOL),
    ("onhost/filehash.py", "sha256_file", "open"): ("each file of the tree, each file sync placed, a .sif, a staged .sif, the relayed uv, wheels", CHUNKS),
    ("onhost/filehash.py", "sha256_file", ".read"): ("each file of the tree, each file sync placed, a .sif, a staged .sif, the relayed uv, wheels", CHUNKS),
    ("onhost/checkout.py", "read_placed", "open"): ("the record of what mnft placed in a directory", "host: 64 MiB (a record larger than that is unreadable: nothing is taken as mnft's)"),
    ("onhost/checkout.py", "read_placed", ".read"): ("the record of what mnft placed in a directory", "host: 64 MiB (a record larger than that is unreadable: nothing is taken as mnft's)"),
    ("onhost/treehash.py", "_load_cache", "open"): ("the hash cache", "host: CACHE_BYTES (1 GiB), larger: hashed again"),
    ("onhost/treehash.py", "_load_cache", ".read"): ("the hash cache", "host: CACHE_BYTES (1 GiB), larger: hashed again"),
    ("onhost/sharemarks.py", "_mount_points", "open"): ("/proc/self/mountinfo", PROC),
    ("onhost/sharemarks.py", "_mount_points", ".read"): ("/proc/self/mountinfo", PROC),
    ("onhost/sharemarks.py", "seen", "os.fdopen"): ("a mark another host left (anyone may plant one)", "host: MARK_BYTES (8 KiB)"),
    ("onhost/sharemarks.py", "seen", ".read"): ("a mark another host left (anyone may plant one)", "host: MARK_BYTES (8 KiB)"),
    ("onhost/treehash.py", "main", ".readline"): ("the controller's rules", STDIN),
    ("onhost/treehash.py", "rsync_version", "subprocess.run"): ("rsync --version", TOOL),
    # ---------------------------------------------------------------- files other people own: their bounds, or the fix to apply
    ("hosts/payload.py", "imported", ".read_text"): ("a host module's source, read for its imports", OWN),
    ("hosts/payload.py", "_build", ".read_bytes"): ("a host module's source, shipped in a payload", OWN),
    ("hosts/payload.py", "pack", ".read_bytes"): ("boot.py, the payload's reader", OWN),
    ("hosts/payload.py", "standalone", ".read_text"): ("entry.py, written into a run directory", OWN),
    ("onhost/leasefiles.py", "lockers", "open"): ("/proc/locks", "host: 1 MiB"),
    ("onhost/procs.py", "process_facts", "open"): ("/proc/<pid>/environ and /proc/<pid>/stat of a GPU's process", PROC),
    ("onhost/procs.py", "process_facts", ".read"): ("/proc/<pid>/environ and /proc/<pid>/stat of a GPU's process", PROC),
    ("onhost/rungpus.py", "_smi", "subprocess.run"): ("nvidia-smi's compute apps (collisions)", TOOL),
    ("onhost/rootfiles.py", "root_text", "os.read"): ("the admin-group file (root's)", "host: 4 KiB"),
    ("onhost/leasehost.py", "main", ".readline"): ("a drain request on stdin", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/kernellog.py", "_run", "subprocess.Popen"): ("mnft's Xid reader through sudo, journalctl -k", "host: the reader's MAX_BYTES (8 MiB); journalctl's last JOURNAL_LINES (50,000) lines"),
    ("onhost/xidreader.py", "kmsg_records", "os.read"): ("the kernel log (/dev/kmsg)", "host: MAX_BYTES (8 MiB) in all, 64 KiB a read"),
    ("onhost/kernellog.py", "read_xids", "open"): ("/proc/uptime", "host: 64 bytes"),
    ("onhost/kernellog.py", "read_xids", ".read"): ("/proc/uptime", "host: 64 bytes"),
    ("onhost/health.py", "remember_seen", "open"): ("this user's record of the boot's GPUs", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/health.py", "remember_seen", ".read"): ("this user's record of the boot's GPUs", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/leasefiles.py", "lockers", ".read"): ("/proc/locks", "host: 1 MiB"),
    ("onhost/leasefiles.py", "update_in_place", "os.pread"): ("a lease file anyone may plant", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/leasefiles.py", "_read", "os.pread"): ("a lease file anyone may plant", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/usageread.py", "usage", "os.pread"): ("a user's usage log (its owner's file, a line per ended lease)", "host: 2 × USAGE_BYTES (2 MiB) a file, 256 files, MAX_USAGE_LINES lines"),
    ("onhost/sessions.py", "session_prepare", ".readline"): ("a session's spec", STDIN),
    ("onhost/sessions.py", "watch", "os.read"): ("the controller's heartbeats", STDIN),
    ("hosts/terminal.py", "_LocalTerminal.read", "os.read"): ("a session's terminal output", "none: streamed to this terminal in 64 KiB chunks, never held"),
    ("hosts/terminal.py", "_SshTerminal.read", ".recv"): ("a session's terminal output", "none: streamed to this terminal in 64 KiB chunks, never held"),
    ("hosts/terminal.py", "interact", ".read"): ("a session's terminal output", "none: streamed to this terminal in 64 KiB chunks, never held"),
    ("hosts/terminal.py", "interact", "os.read"): ("this terminal's keys", "none: 4 KiB chunks sent on, never held"),
    ("hosts/terminal.py", "forward.pump", ".recv"): ("a forwarded TCP connection", "none: 64 KiB chunks carried across, never held"),
    ("onhost/leasefiles.py", "_check_lease", "os.pread"): ("a lease file anyone may plant", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/runs.py", "_environ", "open"): ("/proc/<pid>/environ", PROC),
    ("onhost/runs.py", "_environ", ".read"): ("/proc/<pid>/environ", PROC),
    ("onhost/runs.py", "_zombie", "open"): ("/proc/<pid>/stat", PROC),
    ("onhost/runs.py", "_zombie", ".read"): ("/proc/<pid>/stat", PROC),
    ("onhost/gpucache.py", "boot_id", "open"): ("/proc/sys/kernel/random/boot_id", "host: 64 bytes"),
    ("onhost/gpucache.py", "boot_id", ".read"): ("/proc/sys/kernel/random/boot_id", "host: 64 bytes"),
    ("onhost/gpucache.py", "load_static", "open"): ("a lease file", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/gpucache.py", "load_static", ".read"): ("a lease file", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/hold.py", "hold", ".readline"): ("the holder line from the controller", "host: MAX_LEASE_BYTES (64 KiB)"),
    ("onhost/hold.py", "hold", "os.read"): ("heartbeats and run requests; a run's output", "host: MAX_RUN_BYTES (64 MiB) a request, 1 GiB a run's output"),
    ("onhost/hold.py", "wait_in_line", "os.read"): ("heartbeats", STDIN),
    ("onhost/smi.py", "_spawn_smi", "subprocess.Popen"): ("nvidia-smi", "host: MAX_SMI_BYTES (1 MiB)"),
    ("onhost/smi.py", "run_bounded", "subprocess.Popen"): ("nvidia-smi (the GPU health read)", "host: MAX_SMI_BYTES (1 MiB), SMI_TIMEOUT (5 s)"),
    ("onhost/slurmnode.py", "read_line", ".readline"): ("the launch line from the controller", "host: readline(limit)"),
    ("onhost/slurmnode.py", "relay", ".read1"): ("the agent's output, relayed in pieces srun keeps whole", CHUNKS),
    ("onhost/slurmnode.py", "main", "subprocess.Popen"): ("the agent's output (relay)", CHUNKS),
    ("onhost/slurmnode.py", "run_script", "subprocess.Popen"): ("a host script's output (relay)", CHUNKS),
    ("onhost/slurmnode.py", "run_command", "subprocess.run"): ("mnft's probe run inside the image (its last OUTPUT_KEPT / ERRORS_KEPT characters kept)", TOOL),
    ("board/runs.py", "read_json", "open"): ("live.json, run.json for the page", "none: read(limit + 1) of board.runs.JSON_MAX, never past it"),
    ("board/runs.py", "read_json", ".read"): ("live.json, run.json for the page", "none: read(limit + 1) of board.runs.JSON_MAX, never past it"),
    ("slurm/submit.py", "logs", "limits.last_lines"): ("each node's output.log, its last lines", "LINE_CHARS"),
    ("slurm/submit.py", "logs", "limits.lines"): ("each node's output.log, line by line", "LINE_CHARS"),
    ("slurm/allocation.py", "Allocation.train.reader", ".readline"): ("srun's output, a line at most HOST_OUTPUT_BYTES at a time", "HOST_OUTPUT_BYTES"),
    ("onhost/slurmnode.py", "sees_mark", "open"): ("a mark on the shared filesystem (anyone may write it)", "host: read(4096)"),
    ("onhost/slurmnode.py", "sees_mark", ".read"): ("a mark on the shared filesystem (anyone may write it)", "host: read(4096)"),
    ("onhost/slurmnode.py", "exit_code_of", "open"): ("the run's exit_code file", "host: read(64)"),
    ("onhost/slurmnode.py", "exit_code_of", ".read"): ("the run's exit_code file", "host: read(64)"),
    ("slurm/submit.py", "tail_file", "open"): ("the batch output or a node's output.log, TAIL_CHUNK a poll", "none: read(TAIL_CHUNK); a longer line shown cut and passed"),
    ("slurm/submit.py", "tail_file", ".read"): ("the batch output or a node's output.log, TAIL_CHUNK a poll", "none: read(TAIL_CHUNK); a longer line shown cut and passed"),
                ("slurm/allocation.py", "Allocation.script_step", "subprocess.run"): ("srun's output: every node's reply", "HOST_OUTPUT_BYTES"),
    ("slurm/allocation.py", "Allocation.train", "subprocess.Popen"): ("srun's output, line by line", "HOST_OUTPUT_BYTES"),
    ("slurm/allocation.py", "Allocation.train", "subprocess.run"): ("scancel's answer", "none: Slurm's own tool, a line"),
    ("slurm/cluster.py", "run", "subprocess.run"): ("squeue, scontrol, sbatch answers", "none: Slurm's own tools, proportional to the cluster's jobs"),
        ("board/runs.py", "read_jsonl", "open"): ("live-metrics.jsonl's end", "none: read(keep * 512), the end as measured"),
    ("board/runs.py", "read_jsonl", ".read"): ("live-metrics.jsonl's end", "none: read(keep * 512), the end as measured"),
    ("board/runs.py", "last_lines", "open"): ("a log's end", "none: read(chunk)"),
    ("board/runs.py", "last_lines", ".read"): ("a log's end", "none: read(chunk)"),
}

# The host package (docs/architecture.md): its modules parse their own tools' output, not a host's reply.
HOST_SIDE = {str(p.relative_to(MNFT)) for p in (MNFT / "onhost").glob("*.py")}

# Files other sessions own (the brief's list): an `owner:` row may stand only there.
OTHERS = ("board/", "slurm/", "hosts/lease", "hosts/lab", "cli/tasks.py")

READ_METHODS = {"read_text", "read_bytes", "read", "readline", "readlines", "read1", "recv", "pread", "makefile"}
LOADERS = {("json", "load"), ("tomllib", "load"), ("yaml", "load"), ("yaml", "safe_load"), ("pickle", "load"), ("torch", "load"),
           ("np", "load"), ("numpy", "load"), ("tarfile", "open"), ("zipfile", "ZipFile"), ("os", "read"), ("os", "pread")}
BOUNDED_READERS = {  # mnft.core's readers: each call bounded by the limit it is given
    "limits": {"read_bytes", "read_file", "read_json", "read_at_most", "lines", "last_lines"},
    "yamlfile": {"read_text"},
}


def _mode(call: ast.Call, position: int) -> str:
    if len(call.args) > position and isinstance(call.args[position], ast.Constant) and isinstance(call.args[position].value, str):
        return call.args[position].value
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value.value if isinstance(kw.value, ast.Constant) else "?"
    return "?" if len(call.args) > position else "r"


def _reading(mode: str) -> bool:
    return mode == "?" or not set(mode) & set("wax")


def _captures(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "capture_output" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
            return True
        if kw.arg in ("stdout", "stderr") and isinstance(kw.value, ast.Attribute) and kw.value.attr == "PIPE":
            return True
    return False


def reads_in(path: Path) -> set[tuple[str, str]]:
    """(enclosing function, call) of every reading call in a module."""
    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, stack + [child.name])
                continue
            if isinstance(child, ast.Call):
                f, name = child.func, None
                base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
                if isinstance(f, ast.Name) and f.id == "open" and _reading(_mode(child, 1)):
                    name = "open"
                elif isinstance(f, ast.Name) and f.id in ("EventAccumulator", "recv"):
                    name = f.id
                elif isinstance(f, ast.Attribute) and base in BOUNDED_READERS:
                    if f.attr in BOUNDED_READERS[base]:
                        name = f"{base}.{f.attr}"  # bounded by the limit the call names: listed all the same
                elif isinstance(f, ast.Attribute):
                    if (base, f.attr) in LOADERS:
                        name = f"{base}.{f.attr}"
                    elif base == "os" and f.attr == "fdopen" and _reading(_mode(child, 1)):
                        name = "os.fdopen"
                    elif base == "subprocess" and f.attr in ("run", "Popen", "check_output") and (f.attr == "check_output" or _captures(child)):
                        name = f"subprocess.{f.attr}"
                    elif f.attr == "open" and base != "os" and _reading(_mode(child, 0)):
                        name = ".open"
                    elif f.attr in READ_METHODS and base != "os":
                        name = "." + f.attr
                if name:
                    found.add((".".join(stack) or "<module>", name))
            visit(child, stack)

    visit(ast.parse(path.read_text(), str(path)), [])
    return found


def all_reads() -> set[tuple[str, str, str]]:
    out = set()
    for path in sorted(MNFT.rglob("*.py")):
        rel = str(path.relative_to(MNFT))
        if rel == "core/limits.py":  # the readers themselves
            continue
        out |= {(rel, fn, call) for fn, call in reads_in(path)}
    return out


def test_every_read_in_mnft_is_in_the_table_with_its_bound():
    found = all_reads()
    missing = sorted(found - set(READS))
    gone = sorted(set(READS) - found)
    assert not missing, ("reads with no bound in tests/test_bounded_reads.py READS (bound them through mnft.core.limits, "
                         "or say why none is needed):\n" + "\n".join(f"  {r}" for r in missing))
    assert not gone, "rows of READS whose read is gone:\n" + "\n".join(f"  {r}" for r in gone)


def test_each_bound_is_a_limit_of_mnft_or_says_why():
    names = {name for name, _, _ in limits.TABLE}
    for (module, function, call), (what, bound) in READS.items():
        assert what and bound, (module, function, call)
        if bound.startswith("owner:"):
            assert module.startswith(OTHERS), f"{module}: a read of ours is bounded here, not left to an owner"
        elif not bound.startswith(("none:", "host:")):
            assert bound in names, f"{module} {function}: {bound} is not a limit of mnft.core.limits"


def test_a_hosts_reply_is_parsed_only_through_pyrun():
    """json.loads of a command's stdout anywhere but mnft.hosts.pyrun (last_json, reply) would be a traceback on
    a reply that is not JSON; there it is a failed host in one line."""
    offenders = []
    for path in sorted(MNFT.rglob("*.py")):
        rel = str(path.relative_to(MNFT))
        if rel in ("hosts/pyrun.py",) or rel in HOST_SIDE or rel.startswith(OTHERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "loads" \
                    and node.args and "stdout" in ast.unparse(node.args[0]):
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


# ------------------------------------------------------------------------------------------------ a host's reply


def local_fleet(tmp_path):
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import parse

    path = tmp_path / "inventory.yaml"
    path.write_text("hosts:\n  h1:\n    connection: local\n")
    return Fleet(parse(path.read_text(), path))


def printing(n: int, newline: bool = False, stream: str = "1"):
    from mnft.hosts.command import Command

    return Command(("sh", "-c", f"head -c {n} /dev/zero | tr '\\0' x{'; echo' if newline else ''} >&{stream}"))


@pytest.fixture
def small_output(monkeypatch):
    monkeypatch.setattr(limits, "HOST_OUTPUT_BYTES", 64 * 1024)
    return 64 * 1024


@pytest.mark.parametrize("stream", ["1", "2"])
def test_a_host_that_prints_one_byte_past_host_output_bytes_has_failed_in_one_line(tmp_path, small_output, stream):
    with local_fleet(tmp_path) as fleet:
        host = fleet.inventory.hosts[0]
        at = fleet.run_one(host, printing(small_output, stream=stream))
        past = fleet.run_one(host, printing(small_output + 1, stream=stream))
    assert at.ok and len(at.stdout if stream == "1" else at.stderr) == small_output
    name = "stdout" if stream == "1" else "stderr"
    assert not past.ok and past.stdout == "" and past.error == (
        f"printed a line of more than 64 KiB on {name} (HOST_OUTPUT_BYTES, a limit of mnft's input, see docs/security.md)")


def test_many_lines_past_host_output_bytes_are_refused_and_the_command_ended(tmp_path, small_output):
    from mnft.hosts.command import Command

    with local_fleet(tmp_path) as fleet:
        result = fleet.run_one(fleet.inventory.hosts[0], Command(("sh", "-c", "yes 0123456789abcdef")), timeout=30)
    assert not result.ok and result.seconds < 10  # ended at once, not at its timeout
    assert result.error == "printed more than 64 KiB on stdout (HOST_OUTPUT_BYTES, a limit of mnft's input, see docs/security.md)"


def test_a_stream_that_keeps_nothing_may_print_more_than_host_output_bytes_when_it_is_read(tmp_path, small_output):
    """A run's event stream lasts as long as the run: read as it comes, it is not bounded in total, only by line."""
    from mnft.hosts.command import Command

    burst = "i=0; while [ $i -lt 256 ]; do echo 0123456789012345678901234567890123456789012345678901234567890123; i=$((i+1)); done"
    with local_fleet(tmp_path) as fleet:  # 16 bursts of 16 KiB, a pause after each (a run's events come as it runs)
        process = fleet.start(fleet.inventory.hosts[0], Command(("sh", "-c", f"for b in $(seq 16); do {burst}; sleep 0.1; done")))
        process.keep = False
        count = sum(1 for _ in process.stream())
        process.wait(10)
    assert count == 16 * 256 and process.overflow is None  # 260 KiB read through a 64 KiB bound


def test_a_stream_nobody_reads_past_host_output_bytes_ends_and_says_so(tmp_path, small_output):
    from mnft.hosts.connection import OutputTooLarge

    with local_fleet(tmp_path) as fleet:
        process = fleet.start(fleet.inventory.hosts[0], printing(0).__class__(("sh", "-c", "yes 0123456789abcdef")))
        process.keep = False
        with pytest.raises(OutputTooLarge, match=r"^printed more than 64 KiB not yet read on stdout \(HOST_OUTPUT_BYTES"):
            process.wait(10)


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000, "1" * 5000, "not json", "[1, 2]", ""])
def test_a_reply_that_is_no_json_object_is_a_failed_host_in_one_line(line):
    from mnft.hosts import pyrun
    from mnft.hosts.fleet import HostResult, Status

    result = HostResult("h1", Status.OK, 0, "something first\n" + line + "\n")
    assert pyrun.reply(result, "the probe") is None
    assert result.status is Status.FAILED and result.error.startswith("the probe printed no JSON: ")
    assert "\n" not in result.error and len(result.error) < 1100


def test_a_json_reply_line_that_is_not_json_is_no_answer_not_a_traceback(tmp_path):
    from mnft.hosts.command import Command

    with local_fleet(tmp_path) as fleet:
        process = fleet.start(fleet.inventory.hosts[0], Command(("sh", "-c", "printf '{%s\\n' '[[[[[[[[[[['")))
        reply, said = process.json_reply(10)
    assert reply is None and said[-1].startswith("printed a line that is not JSON: '{[[[[")


def test_a_reply_quoted_in_an_error_is_cut_to_one_short_line():
    from mnft.hosts.fleet import HostResult, Status

    result = HostResult("h1", Status.FAILED, 1, "", "x" * 5_000_000)
    assert len(result.tail(1)) == 1001 and result.tail(1).endswith("…")


# ------------------------------------------------------------------------------------------------ logs collected


def pack(files: dict[str, int]) -> str:
    """An agent's pack: a tar.gz (base64) of files of the given sizes, zeros (they compress to nothing)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, size in files.items():
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    return base64.b64encode(buf.getvalue()).decode()


def test_a_hosts_logs_that_unpack_past_collected_bytes_are_refused_before_anything_is_written(tmp_path, monkeypatch):
    from mnft.run.logs import unpack

    monkeypatch.setattr(limits, "COLLECTED_BYTES", 1 << 20)
    assert unpack(pack({"run/output.log": 1 << 19, "run/b": 1 << 19}), tmp_path / "at") is None
    assert (tmp_path / "at" / "run" / "output.log").stat().st_size == 1 << 19
    why = unpack(pack({"run/output.log": 1 << 19, "run/b": (1 << 19) + 1}), tmp_path / "past")
    assert why == "its logs unpack to more than 1 MiB (COLLECTED_BYTES, a limit of mnft's input, see docs/security.md): nothing unpacked"
    assert not (tmp_path / "past").exists()


def test_a_hosts_logs_of_more_than_collected_files_are_refused(tmp_path, monkeypatch):
    from mnft.run.logs import unpack

    monkeypatch.setattr(limits, "COLLECTED_FILES", 10)
    assert unpack(pack({f"run/{i}": 1 for i in range(10)}), tmp_path / "at") is None
    why = unpack(pack({f"run/{i}": 1 for i in range(11)}), tmp_path / "past")
    assert why.startswith("its logs hold more than 10 files (COLLECTED_FILES") and not (tmp_path / "past").exists()


@pytest.mark.parametrize("packed", [None, "not base64!", base64.b64encode(b"not a tar").decode()])
def test_a_pack_that_is_not_one_is_a_line(tmp_path, packed):
    from mnft.run.logs import unpack

    why = unpack(packed, tmp_path / "x")
    assert why and "\n" not in why and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------ files read back


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # nothing to read: a size
    return path


def record_at(tmp_path, monkeypatch):
    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS", str(tmp_path / "runs"))
    path = tmp_path / "runs" / "20261127-000000-0000"
    path.mkdir(parents=True)
    return records.RunRecord(path, {"run_id": path.name, "hosts": {"h1": {"node_rank": 0}}, "job": {"recipe": "lora"}})


def test_live_json_past_state_bytes_is_one_line(tmp_path, monkeypatch):
    from mnft.run import control

    record = record_at(tmp_path, monkeypatch)
    sparse(record.path / "live.json", limits.STATE_BYTES)  # at the limit: read (NULs: not JSON, no supervisor)
    assert control.supervisor(record) is None
    sparse(record.path / "live.json", limits.STATE_BYTES + 1)
    with pytest.raises(InputError, match=r"live.json: the supervisor's state \(live.json\) is larger than 256 MiB \(STATE_BYTES, a limit"):
        control.supervisor(record)


def test_a_stop_request_past_state_bytes_is_one_line(tmp_path, monkeypatch):
    from mnft.run import records

    record = record_at(tmp_path, monkeypatch)
    sparse(record.path / records.STOP_REQUESTED, limits.STATE_BYTES + 1)
    with pytest.raises(InputError, match=r"stop-requested: the stop request is larger than 256 MiB \(STATE_BYTES"):
        records.stop_requested(record)


def test_step_times_past_state_bytes_are_one_line(tmp_path, monkeypatch):
    from mnft.run import logs

    record = record_at(tmp_path, monkeypatch)
    (record.path / logs.STEP_TIMES).write_text('{"attempt": 1, "t": 1.5, "step": 3}\n')
    assert logs.read_step_times(record) == {1: [(1.5, 3)]}
    sparse(record.path / logs.STEP_TIMES, limits.STATE_BYTES + 1)
    with pytest.raises(InputError, match=r"step-times.jsonl: the step times file is larger than 256 MiB \(STATE_BYTES"):
        logs.read_step_times(record)


def test_the_provision_record_past_state_bytes_is_one_line(tmp_path, monkeypatch):
    from mnft.env import record

    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "home"))
    sparse(record.state_path(), limits.STATE_BYTES + 1)
    with pytest.raises(InputError, match=r"hosts.json: the provision record is larger than 256 MiB \(STATE_BYTES"):
        record.load_state()
    record.state_path().write_text("{not json")
    with pytest.raises(InputError, match=r"hosts.json: the provision record is not JSON .*: delete it and run mnft provision again$"):
        record.load_state()


def test_the_wheelhouse_index_past_state_bytes_is_one_line_and_a_damaged_one_is_made_again(tmp_path):
    from mnft.env.wheelhouse import Wheelhouse

    house = Wheelhouse(tmp_path / "wheels")
    sparse(house.index_path, limits.STATE_BYTES + 1)
    with pytest.raises(InputError, match=r"\.index\.json: the wheelhouse index is larger than 256 MiB \(STATE_BYTES.*: delete it"):
        house._load_index()
    house = Wheelhouse(tmp_path / "wheels")
    house.index_path.write_text("[[[[")
    assert house._load_index() == {}


def test_trainer_state_past_metrics_file_bytes_is_one_line_and_a_half_written_one_none(tmp_path):
    from mnft.run import scrape

    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [')  # a job killed mid-write
    assert scrape.read_json(path) is None
    sparse(path, limits.METRICS_FILE_BYTES + 1)
    with pytest.raises(InputError, match=r"trainer_state.json: the metrics file is larger than 256 MiB \(METRICS_FILE_BYTES"):
        scrape.read_json(path)


def event_record(length: int, data: bytes = b"") -> bytes:
    return struct.pack("<Q", length) + b"\0" * 4 + data + b"\0" * 4


def test_a_tensorboard_event_file_past_metrics_file_bytes_or_claiming_more_than_it_holds_is_one_line(tmp_path):
    from mnft.run import scrape

    run = tmp_path / "tb" / "run1"
    run.mkdir(parents=True)
    path = run / "events.out.tfevents.1.h1"
    path.write_bytes(event_record(4, b"abcd") + event_record(2, b"ab"))
    scrape.event_file_framing(path)  # framed within the file: read
    path.write_bytes(event_record(4, b"abcd") + event_record(1 << 62))  # the reader would allocate 2**62 bytes
    with pytest.raises(InputError, match=r"events.out.tfevents.1.h1: not a TensorBoard event file: a record of 4611686018427387904 bytes in a file of 36"):
        scrape.tensorboard(tmp_path / "tb")
    sparse(path, limits.METRICS_FILE_BYTES + 1)
    with pytest.raises(InputError, match=r"the TensorBoard event file is larger than 256 MiB \(METRICS_FILE_BYTES"):
        scrape.tensorboard(tmp_path / "tb")


def test_an_event_record_cut_short_at_the_end_is_left_to_the_reader(tmp_path):
    from mnft.run import scrape

    path = tmp_path / "events.out.tfevents.1.h1"
    path.write_bytes(event_record(4, b"abcd") + struct.pack("<Q", 30) + b"\0" * 4 + b"only part")  # a job killed mid-write
    scrape.event_file_framing(path)


@pytest.mark.parametrize("name,text,message", [
    ("exit_code", "x" * (4096 + 1), r"exit_code: the exit code file is larger than 4 KiB \(RUN_VALUE_BYTES"),
    ("exit_code", "abc\n", r"exit_code: not an exit code: 'abc' \(collected from the host"),
    ("exit_code", "9" * 40, r"exit_code: an integer of 40 characters: longer than 32"),
    ("ended", "nan", r"ended: not an end time: 'nan'"),
    ("ended", "x" * (4096 + 1), r"ended: the end time file is larger than 4 KiB \(RUN_VALUE_BYTES"),
])
def test_a_collected_exit_code_or_end_that_is_no_such_value_is_one_line(tmp_path, monkeypatch, name, text, message):
    from mnft.run import logs

    record = record_at(tmp_path, monkeypatch)
    run = record.path / "h1" / "run"
    run.mkdir(parents=True)
    (run / "exit_code").write_text("0\n")
    (run / "ended").write_text("1764201600.5\n")
    assert logs.collected_states(record) == {"h1": {"state": "exited", "exit_code": 0, "ended": 1764201600.5}}
    (run / name).write_text(text)
    with pytest.raises(InputError, match=message):
        logs.collected_states(record)


def test_a_gitignore_past_ignore_file_bytes_is_one_line(tmp_path):
    from mnft.sync import gitignore

    (tmp_path / ".gitignore").write_text("*.log\n")
    assert gitignore._ignore_files(tmp_path, [".gitignore"], dict(os.environ), info=False, global_file=False) == [("", ["*.log"])]
    sparse(tmp_path / ".gitignore", limits.IGNORE_FILE_BYTES + 1)
    with pytest.raises(InputError, match=r"\.gitignore: the ignore file is larger than 16 MiB \(IGNORE_FILE_BYTES"):
        gitignore._ignore_files(tmp_path, [".gitignore"], dict(os.environ), info=False, global_file=False)


def test_a_source_file_past_source_bytes_is_not_followed_by_the_preflight(tmp_path, monkeypatch):
    from mnft.run import needs
    from mnft.run.job import Job

    monkeypatch.setattr(needs, "MAX_BYTES", 1024)
    (tmp_path / "train.py").write_text("import helper\n")
    body = "import a_module_no_host_has\n"
    (tmp_path / "helper.py").write_text(body + "#" * (1024 - len(body)))
    job = Job(entry=("train.py",))
    assert "a_module_no_host_has" in {n.module for n in needs.job_needs(job, tmp_path, True).modules}
    (tmp_path / "helper.py").write_text(body + "#" * (1024 - len(body) + 1))
    assert "a_module_no_host_has" not in {n.module for n in needs.job_needs(job, tmp_path, True).modules}
    assert needs.MAX_BYTES == 1024 and limits.SOURCE_BYTES == 4 << 20


def test_a_wheels_metadata_past_wheel_metadata_bytes_is_one_line(tmp_path):
    from mnft.env.wheelhouse import _wheel_metadata

    def wheel(size: int) -> Path:
        path = tmp_path / f"big-1.0-{size}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            head = b"Metadata-Version: 2.1\nName: big\nVersion: 1.0\n\n"
            archive.writestr("big-1.0.dist-info/METADATA", head + b"x" * (size - len(head)))
        return path

    assert _wheel_metadata(wheel(limits.WHEEL_METADATA_BYTES))["version"] == "1.0"
    with pytest.raises(InputError, match=r"big-1.0.dist-info/METADATA: the wheel's metadata is larger than 16 MiB \(WHEEL_METADATA_BYTES"):
        _wheel_metadata(wheel(limits.WHEEL_METADATA_BYTES + 1))


def test_a_recipe_config_is_read_within_the_limits_of_a_job_file(tmp_path):
    from mnft.recipes.config import ConfigError, load_config

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [1, 1]\n" + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
    with pytest.raises(ConfigError, match=r"bomb.yaml:\d+: the YAML document expands to more than 100000 nodes"):
        load_config("lora", [f"config={bomb}"])
    sparse(tmp_path / "big.yaml", limits.JOB_BYTES + 1)
    with pytest.raises(ConfigError, match=r"big.yaml: the config file is larger than 1 MiB"):
        load_config("lora", [f"config={tmp_path / 'big.yaml'}"])
    with pytest.raises(ConfigError, match=r"expects a list like \[a, b\], got .* \(nested too deep\)$"):
        load_config("lora", ["lora_target_modules=" + "[" * 100_000])


# ------------------------------------------------------------------------------------------------ lines of large files


def test_lines_reads_a_log_of_any_line_length_in_bounded_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "output.log"
    with open(path, "wb") as f:
        f.write(b"first\r\nsecond\n\n")
        f.write(b"x" * (64 << 20))  # one 64 MiB line
        f.write(b"\nlast")
    tracemalloc.start()
    try:
        got = list(limits.lines(path, width=100))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == ["first", "second", "", "x" * 100 + limits.CUT, "last"] and peak < 16 << 20
    assert limits.last_lines(path, 2, width=100) == ["x" * 100 + limits.CUT, "last"] or limits.last_lines(path, 2, width=100) == ["last"]


def test_lines_gives_what_read_text_splitlines_gives(tmp_path):
    path = tmp_path / "f"
    for text in ("", "a", "a\n", "a\r\nb\rc\n\n\nd", "\xe9t\xe9\n\x0bx\n", "\n"):
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        assert list(limits.lines(path)) == path.read_text(errors="replace").splitlines(), repr(text)
        assert limits.last_lines(path, 2) == path.read_text(errors="replace").splitlines()[-2:], repr(text)


def test_a_metrics_line_cut_is_never_parsed_as_a_record(tmp_path):
    """The cut keeps a line longer than the parser's bound: a 100 KB line holding a loss is output, not a step."""
    from mnft.run import logs, scrape

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0, "pad": "' + "x" * 200_000 + '"}\n{"step": 2, "loss": 1.0}\n')
    parse = scrape.LineParser("auto")
    assert parse.lines(limits.lines(path, logs.METRIC_WIDTH)) == parse.lines(path.read_text().splitlines())
    assert [r["step"] for r in parse.lines(limits.lines(path, logs.METRIC_WIDTH))] == [2]


# ------------------------------------------------------------------------------------------------ the host-side scripts' own caps


def test_envhost_reads_a_config_past_its_cap_as_no_mesh_and_a_record_past_its_cap_as_none(tmp_path, monkeypatch):
    from mnft.onhost import envfacts, meshpeers

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "mnft_mesh_ed25519").write_text("key")
    config = f"{meshpeers.MESH_BEGIN}\nHost h2\n{meshpeers.MESH_END}\n"
    monkeypatch.setattr(meshpeers, "CONFIG_BYTES", len(config))
    (tmp_path / ".ssh" / "config").write_text(config)
    assert meshpeers.mesh_peers() == ["h2"]
    (tmp_path / ".ssh" / "config").write_text(config + "#")
    assert meshpeers.mesh_peers() == []
    record = tmp_path / "record.json"
    monkeypatch.setattr(envfacts, "RECORD_BYTES", 16)
    record.write_text('{"id": "' + "x" * 6 + '"}')  # 16 bytes
    assert envfacts._read_json(str(record)) == {"id": "xxxxxx"}
    record.write_text('{"id": "' + "x" * 7 + '"}')
    assert envfacts._read_json(str(record)) is None


def test_the_agent_reads_a_run_file_past_its_cap_as_missing(tmp_path, monkeypatch):
    from mnft.onhost import runfiles

    monkeypatch.setattr(runfiles, "RUN_FILE_BYTES", 8)
    (tmp_path / "pgid").write_text("12345678")
    assert runfiles._read(str(tmp_path / "pgid")) == "12345678"
    (tmp_path / "pgid").write_text("123456789")
    assert runfiles._read(str(tmp_path / "pgid"), "gone") == "gone"


def test_the_tree_hash_cache_past_its_cap_is_hashed_again(tmp_path, monkeypatch):
    from mnft.onhost import treehash

    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"version": treehash.CACHE_VERSION, "files": {"a": 1}}))
    assert treehash._load_cache(str(cache)) == {"a": 1}
    monkeypatch.setattr(treehash, "CACHE_BYTES", cache.stat().st_size - 1)
    assert treehash._load_cache(str(cache)) == {}


def test_the_probe_reads_no_more_of_torchs_version_py_than_its_cap(tmp_path, monkeypatch):
    from mnft.onhost import facts

    path = tmp_path / "version.py"
    monkeypatch.setattr(facts, "SOURCE_CHARS", 32)
    path.write_text("__version__ = '2.13.0'\n" + "#" * 9)  # 32 characters
    assert facts._assignments(str(path)) == {"__version__": "2.13.0"}
    path.write_text("__version__ = '2.13.0'\n" + "#" * 10)
    with pytest.raises(ValueError, match="larger than 32 characters"):
        facts._assignments(str(path))


def test_setups_host_script_refuses_a_public_key_past_its_cap(tmp_path, monkeypatch):
    from mnft.onhost import setuphost

    key = tmp_path / "id"
    key.write_text("private")
    monkeypatch.setattr(setuphost, "PUBLIC_KEY_CHARS", 16)
    (tmp_path / "id.pub").write_text("ssh-ed25519 AAAA")
    assert setuphost.op_keygen({"path": str(key), "comment": "c"})["public"] == "ssh-ed25519 AAAA"
    (tmp_path / "id.pub").write_text("ssh-ed25519 AAAAB")
    with pytest.raises(RuntimeError, match="larger than 16 characters: not a public key"):
        setuphost.op_keygen({"path": str(key), "comment": "c"})


def test_a_peers_reply_line_is_read_to_its_cap():
    from mnft.onhost import linkagent

    assert linkagent.REPLY_BYTES == 65536
    source = Path(linkagent.__file__).read_text()
    assert "readline(REPLY_BYTES)" in source


def test_the_scan_sees_an_unbounded_read(tmp_path):
    """The scanner itself: a read_text, a json.load of an open file, a captured program, a socket's recv."""
    path = tmp_path / "m.py"
    path.write_text("import json, subprocess\n"
                    "def f(p, s):\n    return p.read_text()\n"
                    "class C:\n    def g(self, p):\n        with open(p) as fh:\n            return json.load(fh)\n"
                    "def h():\n    return subprocess.run(['ls'], capture_output=True)\n"
                    "def w(p):\n    open(p, 'w').write('x')\n"
                    "def r(s):\n    return s.recv(10)\n"
                    "def b(p):\n    return limits.read_bytes(p, 1, 'x', 'y')\n")
    assert reads_in(path) == {("f", ".read_text"), ("C.g", "open"), ("C.g", "json.load"), ("h", "subprocess.run"), ("r", ".recv"),
                              ("b", "limits.read_bytes")}
