"""A job is data: what torchrun starts on every host, how it resumes, where its metrics come from.

mnft's recipes and a lab's own training script are the same kind of value. A job comes from the command line
(`-- SCRIPT.py ARGS…`, `-- -m package.module ARGS…`, `--recipe lora`) or from a job file (YAML, validated as
strictly as an inventory). `mnft.run.launch.plan` turns a job and an inventory into one torchrun command per host.

Arguments given on the command line are passed verbatim: never split again, never expanded, never run by a
shell. A job file's values may carry placeholders that mnft fills in per run and host (`{output_dir}`,
`{world_size}`, …, see PLACEHOLDERS); `{{` and `}}` are literal braces. An unknown placeholder is bad input.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from mnft.core import yamlfile
from mnft.core.errors import InputError
from mnft.hosts.command import check_env_name, is_secret_name
from mnft.image.runtime import check_ref
from mnft.run import torchrunargs

RECIPES = ("lora", "full")
RESERVED_KEYS = ("output_dir", "resume")  # recipe settings mnft sets itself
OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=(.*)$", re.S)

# Filled in by mnft for every host of a run (mnft.run.launch.plan). latest_checkpoint only on resume.
PLACEHOLDERS = {
    "output_dir": "the job's output directory on the host (<workdir>/outputs/<job_id>): the same job id across resumes",
    "run_id": "this run's id (a resume gets a new one)",
    "job_id": "the job's id: the first run's id, kept by every resume",
    "nnodes": "number of hosts",
    "nproc_per_node": "processes on this host (its slots)",
    "world_size": "processes in all (sum of slots)",
    "node_rank": "this host's node rank",
    "master_addr": "the master's cluster address",
    "master_port": "the rendezvous port",
    "workdir": "the job's working directory on the host (= output_dir): the code it was started with, and what it writes",
    "data_dir": "the host's data directory",
    "latest_checkpoint": "the latest complete checkpoint (only in resume.args)",
    "latest_checkpoint_name": "its name in the checkpoints directory: epoch_1, checkpoint-40 (only in resume.args)",
}
RESUME_ONLY = frozenset({"latest_checkpoint", "latest_checkpoint_name"})

# Checkpoint layouts mnft can find "the latest complete checkpoint" in (see mnft.run.checkpoints).
LAYOUTS = ("hf", "torchtune", "sana", "glob", "mnft", "none")
# Metrics formats (see mnft.run.scrape).
METRIC_FORMATS = ("auto", "hf", "torchtune", "sana", "jsonl", "plain", "tensorboard", "regex", "mnft", "none")

# torchrun options mnft sets itself (or that would break supervision, logs or ranks) are refused however argparse
# would read them (abbreviated, --opt=value, PET_* variables): mnft.run.torchrunargs.

JOB_KEYS = ("name", "script", "module", "recipe", "args", "env", "pass_env", "resume", "metrics", "torchrun", "elastic", "requires", "gpus", "image", "notify",
            "sweep")
# What mnft's recipes import beyond what reading their source finds (mnft.run.needs reads the rest).
RECIPE_REQUIRES = ("torch", "transformers", "peft", "safetensors", "yaml")
RESUME_KEYS = ("layout", "checkpoints", "pattern", "marker", "args", "exit_codes")
METRICS_KEYS = ("format", "path", "regex")


@dataclass(frozen=True)
class ResumeRule:
    """How a job continues from its latest checkpoint.

    layout: where "the latest complete checkpoint" is (hf: checkpoint-N holding trainer_state.json; torchtune:
    epoch_N/step_N holding recipe_state.pt; sana: the target of latest.pth; glob: `pattern` + `marker`; mnft: the
    recipes find it themselves; none: mnft does not look). args: appended on resume, only when a complete
    checkpoint was found (for layout none/mnft: always). exit_codes: the job's "stopped on its own, resume me".
    declared: the job said how it resumes (a job file's `resume:`): `layout: none` with no args then means the
    script resumes itself from its own directory (VILA's way), not that it has no rule.
    """

    layout: str = "none"
    checkpoints: str = "{output_dir}"
    pattern: str | None = None
    marker: str | None = None
    args: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = ()
    declared: bool = False


@dataclass(frozen=True)
class MetricsSource:
    """Where rank 0's training metrics are: its output (path None) or a file / directory on its host."""

    format: str = "auto"
    path: str | None = None
    regex: str | None = None


@dataclass(frozen=True)
class Job:
    entry: tuple[str, ...]  # torchrun's positional part: ("train.py",) or ("-m", "pkg.train")
    args: tuple[str, ...] = ()  # the job file's arguments (placeholders filled in per host)
    extra_args: tuple[str, ...] = ()  # the command line's arguments: verbatim, after args
    env: tuple[tuple[str, str], ...] = ()  # NAME -> value (placeholders filled in); never a secret
    pass_env: tuple[str, ...] = ()  # names whose values come from the controller's environment (secrets too)
    resume: ResumeRule = ResumeRule()
    metrics: MetricsSource = MetricsSource()
    torchrun: tuple[str, ...] = ()  # extra torchrun options, before the entry point
    name: str | None = None
    recipe: str | None = None  # lora / full: one of mnft's own recipes
    source: str | None = None  # the job file, for messages and the run record
    elastic: bool = False
    requires: tuple[str, ...] = ()  # modules every host's Python must import (a job file's `requires:`, a recipe's own)
    gpus: int | None = None  # a job file's `gpus:`: the devices it takes on each host (--gpus overrides); None: every one
    image: str | None = None  # a job file's `image:` (--image overrides): the container image its torchrun runs in; None: the host's Python
    notify: str | None = None  # a job file's `notify:` (--notify overrides): a shell line told of the run's end (mnft.run.notify); not recorded
    sweep: Any = None  # a job file's `sweep:` (mnft.run.sweepspec.SweepSpec): one run per point; not recorded (each point is a run)

    @property
    def kind(self) -> str:
        return "recipe" if self.recipe else ("module" if self.entry[0] == "-m" else "script")

    @property
    def script(self) -> str | None:
        return None if self.kind != "script" else self.entry[0]

    @property
    def label(self) -> str:
        if self.recipe:
            return f"recipe {self.recipe}"
        return self.name or (f"-m {self.entry[1]}" if self.kind == "module" else self.entry[0])

    def with_extra(self, extra: tuple[str, ...]) -> "Job":
        return replace(self, extra_args=self.extra_args + tuple(extra))

    def to_record(self) -> dict[str, Any]:
        """The job as run.json keeps it (a resume rebuilds the same job from it)."""
        return {
            "kind": self.kind, "name": self.name, "recipe": self.recipe, "source": self.source, "entry": list(self.entry),
            "args": list(self.args), "extra_args": list(self.extra_args), "env": dict(self.env), "pass_env": list(self.pass_env),
            "resume": {"layout": self.resume.layout, "checkpoints": self.resume.checkpoints, "pattern": self.resume.pattern,
                       "marker": self.resume.marker, "args": list(self.resume.args), "exit_codes": list(self.resume.exit_codes),
                       "declared": self.resume.declared},
            "metrics": {"format": self.metrics.format, "path": self.metrics.path, "regex": self.metrics.regex},
            "torchrun": list(self.torchrun), "elastic": self.elastic, "requires": list(self.requires), "gpus": self.gpus,
            "image": self.image,
        }


def resumable(job: Job) -> bool:
    """Whether the job can be continued: a recipe, a layout mnft finds checkpoints by, resume args, or a rule the
    job declared (`resume: {layout: none}`: the script resumes itself)."""
    return bool(job.recipe or job.resume.declared or job.resume.layout != "none" or job.resume.args)


def from_record(data: Mapping[str, Any]) -> Job:
    resume, metrics = data.get("resume") or {}, data.get("metrics") or {}
    return Job(
        entry=tuple(data["entry"]), args=tuple(data.get("args") or ()), extra_args=tuple(data.get("extra_args") or ()),
        env=tuple((data.get("env") or {}).items()), pass_env=tuple(data.get("pass_env") or ()),
        resume=ResumeRule(resume.get("layout", "none"), resume.get("checkpoints") or "{output_dir}", resume.get("pattern"),
                          resume.get("marker"), tuple(resume.get("args") or ()), tuple(resume.get("exit_codes") or ()),
                          resume.get("declared") is True),
        metrics=MetricsSource(metrics.get("format", "auto"), metrics.get("path"), metrics.get("regex")),
        torchrun=tuple(data.get("torchrun") or ()), name=data.get("name"), recipe=data.get("recipe"), source=data.get("source"),
        elastic=bool(data.get("elastic")), requires=tuple(data.get("requires") or ()),
        gpus=data.get("gpus") if isinstance(data.get("gpus"), int) and not isinstance(data.get("gpus"), bool) else None,
        image=data.get("image") if isinstance(data.get("image"), str) else None,
    )


# ------------------------------------------------------------------------------------------------ the three sources


def recipe_job(recipe: str, overrides: tuple[str, ...] = ()) -> Job:
    """mnft's own recipe as a job: `-m mnft.recipes.<name> output_dir=… key=value…`, resumed by `resume=latest`
    (each rank finds its own latest complete checkpoint), metrics in the recipe's metrics.jsonl."""
    if recipe not in RECIPES:
        raise InputError(f"--recipe {recipe!r}: unknown recipe (choose from: {', '.join(RECIPES)})")
    return Job(
        entry=("-m", f"mnft.recipes.{recipe}"),
        args=("output_dir={output_dir}",),
        extra_args=parse_overrides(overrides),
        resume=ResumeRule(layout="mnft", checkpoints="{output_dir}/checkpoints", args=("resume=latest",)),
        metrics=MetricsSource("mnft", "{output_dir}/metrics.jsonl"),
        recipe=recipe,
        elastic=True,
        requires=RECIPE_REQUIRES,
    )


def parse_overrides(overrides: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """--set key=value for a recipe: well-formed, and not one mnft sets itself."""
    out = []
    for item in overrides:
        match = OVERRIDE.match(item)
        if not match:
            raise InputError(f"recipe override {item!r}: expected key=value")
        if match.group(1) in RESERVED_KEYS:
            raise InputError(f"recipe override {item!r}: {match.group(1)} is set by mnft (use --resume to continue a run)")
        out.append(item)
    return tuple(out)


def cli_job(argv: list[str] | tuple[str, ...]) -> Job:
    """`-- SCRIPT.py ARGS…` or `-- -m package.module ARGS…`: the entry point and its arguments, verbatim."""
    argv = tuple(argv)
    if not argv:
        raise InputError("nothing after --: give the entry point, e.g. -- train.py --lr 1e-4 or -- -m package.train")
    if argv[0] in ("-m", "--module"):
        if len(argv) < 2 or not _module_name(argv[1]):
            raise InputError(f"-- -m {argv[1] if len(argv) > 1 else ''}: expected a module name like package.train")
        return Job(entry=("-m", argv[1]), extra_args=argv[2:])
    return Job(entry=(_script_path(argv[0], "the entry point after --"),), extra_args=argv[1:])


def _module_name(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", text))  # whole: no trailing newline


def _script_path(text: str, where: str) -> str:
    if not isinstance(text, str) or not text or text.startswith("-"):
        raise InputError(f"{where}: {text!r} is not a script path (give SCRIPT.py, or -m package.module)")
    if _control(text):
        raise InputError(f"{where}: the script path must be a single line without control characters")
    return text


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def load_job_file(path: Path, sweep_keys: tuple[str, ...] = ()) -> Job:
    """A job file: strict YAML (unknown keys refused with a suggestion), placeholders checked (a sweep's keys, its
    own `sweep:` or --sweep's `sweep_keys`, are placeholders too)."""
    where = str(path)
    doc = yamlfile.load(yamlfile.read_text(path, "job file", "--job"), where)
    if not isinstance(doc, dict) or not doc:
        raise InputError(f"{where}: a job file is a mapping with 'script' or 'module' (see docs/jobs.md)")
    _known(doc, JOB_KEYS, where, "")
    at = lambda key, m=doc: f"{where}{yamlfile.line_of(m, key)}"  # noqa: E731

    entries = [k for k in ("script", "module", "recipe") if doc.get(k) is not None]
    if len(entries) != 1:
        raise InputError(f"{where}: give exactly one of 'script', 'module' or 'recipe' (found: {', '.join(entries) or 'none'})")
    args = _strings(doc.get("args"), at("args"), "args")
    if doc.get("recipe") is not None:
        base = recipe_job(_text(doc["recipe"], at("recipe"), "recipe"), ())
        entry, args = base.entry, base.args + args
    elif doc.get("module") is not None:
        module = _text(doc["module"], at("module"), "module")
        if not _module_name(module):
            raise InputError(f"{at('module')}: key 'module': {module!r} is not a module name like package.train")
        entry = ("-m", module)
    else:
        entry = (_script_path(_text(doc["script"], at("script"), "script"), f"{at('script')}: key 'script'"),)

    env, pass_env = _env(doc.get("env"), doc.get("pass_env"), where, at)
    resume = _resume(doc.get("resume"), where, at("resume")) if doc.get("resume") is not None else None
    metrics = _metrics(doc.get("metrics"), where, at("metrics")) if doc.get("metrics") is not None else None
    torchrun = _torchrun(_strings(doc.get("torchrun"), at("torchrun"), "torchrun"), at("torchrun"))
    elastic = doc.get("elastic", False)
    if not isinstance(elastic, bool):
        raise InputError(f"{at('elastic')}: key 'elastic': expected true or false, got {elastic!r}")
    name = doc.get("name")
    if name is not None:
        name = _text(name, at("name"), "name")
        if _control(name) or len(name) > 200:  # a label in tables, records and messages: one line
            raise InputError(f"{at('name')}: key 'name': {name[:60]!r}: a job name is one line of at most 200 characters without control characters")
    requires = _strings(doc.get("requires"), at("requires"), "requires")
    for module in requires:
        if not _module_name(module):
            raise InputError(f"{at('requires')}: key 'requires': {module!r} is not a module name (the name you import, e.g. peft)")
    gpus = doc.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 64):
        raise InputError(f"{at('gpus')}: key 'gpus': {gpus!r}: a whole number of GPUs per host from 1 to 64 (leave it out: every GPU)")
    image = check_ref(doc["image"], f"{at('image')}: key 'image'") if doc.get("image") is not None else None
    notify = doc.get("notify")
    if notify is not None and (not isinstance(notify, str) or not notify.strip() or "\x00" in notify or "\n" in notify.strip()):
        raise InputError(f"{at('notify')}: key 'notify': {str(notify)[:60]!r}: one shell line, run on the controller when the run ends "
                         "(its outcome in MNFT_NOTIFY_* variables: see docs/lab.md)")
    sweep = None
    if doc.get("sweep") is not None:
        from mnft.run.sweepspec import from_job

        sweep = from_job(doc["sweep"], at("sweep") + ": sweep", frozenset(PLACEHOLDERS))
    extra = frozenset(sweep_keys) | frozenset(sweep.keys if sweep is not None else ())
    job = Job(entry=entry, args=args, env=env, pass_env=pass_env, torchrun=torchrun, name=name, source=where, elastic=elastic,
              requires=requires, gpus=gpus, image=image, notify=notify.strip() if notify is not None else None, sweep=sweep)
    if doc.get("recipe") is not None:
        base = recipe_job(doc["recipe"])
        job = replace(job, recipe=doc["recipe"], resume=base.resume, metrics=base.metrics, requires=base.requires + requires)
    if resume is not None:
        job = replace(job, resume=resume)
    if metrics is not None:
        job = replace(job, metrics=metrics)
    for key, values in (("args", job.args), ("env", [v for _, v in job.env]), ("resume.args", job.resume.args),
                        ("resume.checkpoints", [job.resume.checkpoints]), ("metrics.path", [job.metrics.path or ""])):
        for value in values:
            check_placeholders(value, f"{where}: {key}", resume_args=key == "resume.args", extra=extra if key in ("args", "env") else frozenset())
    return job


def _known(mapping: dict, keys: tuple[str, ...], where: str, prefix: str) -> None:
    for key in mapping:
        if key not in keys:
            raise InputError(f"{where}{yamlfile.line_of(mapping, key)}: unknown key {prefix}{key!r}{yamlfile.suggest(str(key), keys)} "
                             f"(known: {', '.join(keys)})")


def _text(value: Any, at: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value) == "":
        raise InputError(f"{at}: key {key!r}: expected text, got {value!r}")
    return str(value)


def _strings(value: Any, at: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(f"{at}: key {key!r}: expected a list of arguments (one YAML list item each), got {type(value).__name__}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise InputError(f"{at}: key {key!r}: {item!r} is not a plain argument (text or a number)")
        if isinstance(item, str) and "\x00" in item:  # no process can be given it (execve ends an argument at NUL)
            raise InputError(f"{at}: key {key!r}: {item[:60]!r} holds a NUL character")
        out.append(str(item))
    return tuple(out)


def _env(env: Any, pass_env: Any, where: str, at) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    pairs = []
    if env is not None:
        if not isinstance(env, dict):
            raise InputError(f"{at('env')}: key 'env': expected a mapping NAME: value")
        for name, value in env.items():
            try:
                check_env_name(name)
            except InputError:
                raise InputError(f"{where}{yamlfile.line_of(env, name)}: env: {name!r} is not a variable name (letters, digits, _)") from None
            if is_secret_name(name):
                raise InputError(f"{where}{yamlfile.line_of(env, name)}: env: {name} is a secret: never write its value in a job file; "
                                 f"list it under pass_env (its value then comes from your environment or --env-file)")
            if isinstance(value, bool):
                value = "1" if value else "0"
            if value is None or not isinstance(value, (str, int, float)):
                raise InputError(f"{where}{yamlfile.line_of(env, name)}: env: {name}: expected a value (text or a number)")
            if "\x00" in str(value):
                raise InputError(f"{where}{yamlfile.line_of(env, name)}: env: {name}: the value holds a NUL character")
            if torchrunargs.owned_env(name):
                raise InputError(f"{where}{yamlfile.line_of(env, name)}: env: {name} sets a torchrun option mnft owns "
                                 f"(torchrun reads {name} as --{name[4:].lower().replace('_', '-')})")
            pairs.append((name, str(value)))
    names = _strings(pass_env, at("pass_env"), "pass_env")
    for name in names:
        try:
            check_env_name(name)
        except InputError:
            raise InputError(f"{at('pass_env')}: pass_env: {name!r} is not a variable name (letters, digits, _)") from None
        if torchrunargs.owned_env(name):
            raise InputError(f"{at('pass_env')}: pass_env: {name} sets a torchrun option mnft owns "
                             f"(torchrun reads {name} as --{name[4:].lower().replace('_', '-')})")
    return tuple(pairs), names


def _resume(data: Any, where: str, at: str) -> ResumeRule:
    if not isinstance(data, dict):
        raise InputError(f"{at}: key 'resume': expected a mapping (layout, checkpoints, args, exit_codes, …)")
    _known(data, RESUME_KEYS, where, "resume.")
    line = lambda key: f"{where}{yamlfile.line_of(data, key)}"  # noqa: E731
    layout = data.get("layout", "none")
    if layout not in LAYOUTS:
        raise InputError(f"{line('layout')}: resume.layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    pattern = data.get("pattern")
    marker = data.get("marker")
    if layout == "glob" and not (isinstance(pattern, str) and pattern and isinstance(marker, str) and marker):
        raise InputError(f"{line('layout')}: resume.layout glob needs 'pattern' (e.g. step_*) and 'marker' (the file written last)")
    if layout != "glob" and (pattern is not None or marker is not None):
        raise InputError(f"{line('pattern' if pattern is not None else 'marker')}: resume.pattern/marker go with layout glob")
    for value, key in ((pattern, "pattern"), (marker, "marker")):
        if value is not None and ("/" in value.strip("/") if key == "pattern" else value.startswith("/") or ".." in value.split("/")):
            raise InputError(f"{line(key)}: resume.{key} {value!r}: a name inside the checkpoints directory")
    codes = data.get("exit_codes") or []
    if not isinstance(codes, list) or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255 for c in codes):
        raise InputError(f"{line('exit_codes')}: resume.exit_codes: expected a list of exit codes 1-255, got {codes!r}")
    args = _strings(data.get("args"), line("args"), "resume.args")
    for a in args:  # a malformed placeholder is bad input here too, before fields_of reads the fields
        check_placeholders(a, f"{line('args')}: resume.args", resume_args=True)
    uses_latest = any(RESUME_ONLY & set(fields_of(a)) for a in args)
    if uses_latest and layout in ("none", "mnft"):
        raise InputError(f"{line('args')}: resume.args use {{latest_checkpoint}}: set resume.layout (hf, torchtune, sana or glob) so mnft can find it")
    checkpoints = data.get("checkpoints", "{output_dir}")
    checkpoints = _text(checkpoints, line("checkpoints"), "resume.checkpoints")
    return ResumeRule(layout, checkpoints, pattern, marker, args, tuple(codes), declared=True)


def _metrics(data: Any, where: str, at: str) -> MetricsSource:
    if isinstance(data, str):
        data = {"format": data}
    if not isinstance(data, dict):
        raise InputError(f"{at}: key 'metrics': expected a format name or a mapping (format, path, regex)")
    _known(data, METRICS_KEYS, where, "metrics.")
    line = lambda key: f"{where}{yamlfile.line_of(data, key)}"  # noqa: E731
    fmt = data.get("format", "auto")
    if fmt not in METRIC_FORMATS:
        raise InputError(f"{line('format')}: metrics.format {fmt!r}: use one of {', '.join(METRIC_FORMATS)}")
    path = data.get("path")
    if path is not None:
        path = _text(path, line("path"), "metrics.path")
    regex = data.get("regex")
    if fmt == "regex":
        from mnft.run.scrape import compile_regex

        compile_regex(regex, line("regex"))
    elif regex is not None:
        raise InputError(f"{line('regex')}: metrics.regex goes with format regex")
    if fmt == "tensorboard" and not path:
        raise InputError(f"{line('format')}: metrics format tensorboard needs 'path': the directory of the event files")
    return MetricsSource(fmt, path, regex)


def _torchrun(options: tuple[str, ...], at: str) -> tuple[str, ...]:
    why = torchrunargs.refusal(options)  # as torchrun's argparse reads them: --nnod, --nnodes=2, -t3 included
    if why:
        raise InputError(f"{at}: {why}")
    return options


# ------------------------------------------------------------------------------------------------ placeholders


def fields_of(template: str) -> list[str]:
    """The placeholder names in a template (`{{`/`}}` are literal braces); a malformed one is a ValueError."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"{{{name}}} takes no format spec or conversion")
        names.append(name)
    return names


def check_placeholders(template: str, where: str, *, resume_args: bool = False, extra: frozenset[str] = frozenset()) -> None:
    try:
        names = fields_of(template)
    except ValueError as exc:
        raise InputError(f"{where}: {template!r}: bad placeholder ({exc}); write {{{{ and }}}} for literal braces") from None
    for name in names:
        if name not in PLACEHOLDERS and name not in extra:
            raise InputError(f"{where}: {template!r}: unknown placeholder {{{name}}} (known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
        if name in RESUME_ONLY and not resume_args:
            raise InputError(f"{where}: {template!r}: {{{name}}} is known only when resuming: use it in resume.args")


def fill(template: str, values: Mapping[str, Any]) -> str:
    """A template with its placeholders filled in (checked when the job was loaded)."""
    return template.format_map(_Values(values))


class _Values(dict):
    def __missing__(self, key: str) -> str:
        raise InputError(f"placeholder {{{key}}} has no value in this run")
