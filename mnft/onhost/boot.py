"""The payload's first module on a host: serves the payload's modules to `import` and runs its entry.

A payload (mnft.hosts.payload builds it on the controller) is one header line, `<bytes> <magic> <entry>`, and that
many bytes of zlib-compressed marshal data: {module name: (source, bytecode or b"")}. BOOTSTRAP, the host Python's `-c`, reads it
from stdin (which stays open after it for the entry: a `hold` watches it) and runs this module's source with it.
This module then puts a finder first on sys.meta_path that answers for PACKAGE and its modules from the payload
alone: nothing of mnft's is read from a file on the host, so no file a user could have written is ever imported in
its place. A module whose bytecode was compiled by a Python with this one's magic number runs as it is; any other
Python compiles its source. Then it calls the entry's main(sys.argv[1:]) and exits with what it returns (through the
entry's own `leave(code)` where it has one: an entry whose threads read stdin ends without the interpreter's shutdown).

Standard library only, Python 3.8 syntax.
"""

import marshal
import sys

PACKAGE = "mnft_onhost"
OLDEST = (3, 8)  # the oldest host Python mnft's host modules are written for
OLD_PYTHON = ("mnft: this host's Python is %d.%d; mnft's host side needs Python 3.8 or newer: give the host one (the inventory's "
              "`python:`; in an image, its python3)")
NO_ZLIB = "mnft: this host's Python cannot read mnft's payload (%s): give the host a Python built with zlib"
# What every bootstrap does first, in any Python (2.7 included, to say it once): the working directory off sys.path (a
# `python -c` looks there first: a planted zlib.py or json.py is never imported, however the host's Python was built),
# then a Python too old for the payload refused in one line, exit 3.
_GUARD = ("import sys\nsys.path[:]=[p for p in sys.path if p]\nif sys.version_info<%r:\n sys.stderr.write(%r%%tuple(sys.version_info[:2])+'\\n')\n"
          " sys.exit(3)\ntry:\n import marshal,zlib\nexcept ImportError as e:\n sys.stderr.write(%r%%e+'\\n')\n sys.exit(3)\n"
          % (OLDEST, OLD_PYTHON, NO_ZLIB))
BOOTSTRAP = _GUARD + (
    "i=sys.stdin.buffer;h=i.readline();b=i.read(int(h.split()[0]));d=marshal.loads(zlib.decompress(b))\n"
    "exec(d['boot'][0],{'__name__':'mnft_boot','HEAD':h,'BODY':b,'MODULES':d})"
)
# the same from a payload file named first on the command line (taken off sys.argv): a process that outlives the
# channel it came by (a run's keeper) or whose stdin is a terminal (a shell's session) starts from its run directory's
# copy, which only its user can have written (the run directory is 0700, the file 0600)
FILE_BOOTSTRAP = _GUARD + (
    "f=open(sys.argv.pop(1),'rb');h=f.readline();b=f.read(int(h.split()[0]));f.close();d=marshal.loads(zlib.decompress(b))\n"
    "exec(d['boot'][0],{'__name__':'mnft_boot','HEAD':h,'BODY':b,'MODULES':d})"
)


class Finder(object):
    """Answers `import mnft_onhost[.name]` from one payload's modules (a flat package: no subpackages)."""

    def __init__(self, modules, magic, raw):
        self.modules = modules
        self.magic = magic
        self.raw = raw  # the payload as it came (header and body): what a host module ships on (a keeper's start)

    def _short(self, name):
        if name == PACKAGE:
            return "__init__"
        if name.startswith(PACKAGE + ".") and name[len(PACKAGE) + 1:] in self.modules:
            return name[len(PACKAGE) + 1:]
        return None

    def find_spec(self, name, path=None, target=None):
        short = self._short(name)
        if short is None or short not in self.modules:
            return None
        spec = sys.modules["_frozen_importlib"].ModuleSpec  # importlib itself is not imported: nothing read from a path
        return spec(name, self, origin="mnft payload", is_package=short == "__init__")

    def get_source(self, name):
        """The module's source, for a traceback's lines (linecache asks the module's loader)."""
        short = self._short(name)
        return self.modules[short][0].decode("utf-8", "replace") if short in self.modules else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        short = self._short(module.__name__)
        source, code = self.modules[short]
        if code and self.magic == _magic():
            compiled = marshal.loads(code)
        else:
            compiled = compile(source, filename(short), "exec", dont_inherit=True)
        exec(compiled, module.__dict__)


def _magic():
    return sys.modules["_frozen_importlib_external"].MAGIC_NUMBER.hex()


def filename(short):
    """The name a host module's code carries (in tracebacks), the same whether the controller or the host compiled it."""
    return "<%s>/%s.py" % (PACKAGE, short)


def exit_code(code):
    """What an entry's main returned, as a process's exit status: None 0, an int as it is (0-255), anything else 1."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) and not isinstance(code, bool) else 1


def _ours(finder):
    return getattr(finder, "raw", None) is not None and hasattr(finder, "modules")


def current():
    """The payload this process runs (header and body), as it came: what a host module hands on to a process it
    starts with the same code (a run's keeper, a session's)."""
    for finder in sys.meta_path:
        if _ours(finder):
            return finder.raw
    raise RuntimeError("not running from an mnft payload")


def _split(raw):
    head, _, body = raw.partition(b"\n")
    words = head.split()
    return head + b"\n", body[: int(words[0])], words[1].decode(), words[2].decode()


def _install(raw, modules=None):
    head, body, magic, entry = _split(raw)
    if modules is None:
        import zlib

        modules = marshal.loads(zlib.decompress(body))
    sys.meta_path.insert(0, Finder(modules, magic, head + body))
    return entry


def _entry(entry):
    return __import__(PACKAGE + "." + entry, fromlist=["main"])


def _main_of(entry):
    return _entry(entry).main


def run(raw, argv):
    """Run another payload's entry in this process (a script the controller sends to a `hold` or to the probe's
    session): its modules in place of this process's own for the call, which are back afterwards. Returns what its
    main returns; SystemExit goes through as it came."""
    saved_modules = dict((k, sys.modules.pop(k)) for k in list(sys.modules) if k == PACKAGE or k.startswith(PACKAGE + "."))
    saved_finders = list(sys.meta_path)
    saved_argv = sys.argv
    sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]
    try:
        entry = _install(raw)
        sys.argv = ["-c"] + list(argv)
        return _main_of(entry)(list(argv))
    finally:
        sys.argv = saved_argv
        for k in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
            del sys.modules[k]
        sys.modules.update(saved_modules)
        sys.meta_path[:] = saved_finders


def start(head, body, modules):
    """What BOOTSTRAP runs: the payload's modules served, then its entry's main; the process exits with its code."""
    module = _entry(_install(head + body, modules))
    code = exit_code(module.main(sys.argv[1:]))
    # an entry whose threads may be blocked in a read of stdin ends by its own `leave` (os._exit after a flush): the
    # interpreter's shutdown would abort on the buffered reader's lock
    getattr(module, "leave", sys.exit)(code)


if __name__ == "mnft_boot":
    start(HEAD, BODY, MODULES)  # noqa: F821 - given by BOOTSTRAP
