"""Secrets out of everything traindx writes or shows: by the name they are stored under
(`HF_TOKEN`, `--wandb_key`) and by their value's shape wherever they appear (a password in a
database URL, an `AccountKey=` in a connection string, a Sentry DSN's key, a GitHub/Hugging Face/
OpenAI/Slack/AWS token, a JWT, a private key block).

One module for the manifest (env, command, options), the report (command, env, log lines) and
everything written under a run folder: `Redactor` also knows one job's own secret values (from its
environment and arguments) and hides them verbatim wherever they appear, shape or not; the
launcher passes each line of log.txt through it, the shim the arguments it records. Non-secrets
must survive: a URL without credentials, a path, a git commit hash, a learning rate,
`TOKENIZERS_PARALLELISM`, `--key-dim 64`.

Standard library only: the shim loads this file by its path inside the job's own interpreter.
"""

from __future__ import annotations  # annotations stay text in the job's interpreter

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"

# words in a name that say its value is a secret whatever it looks like
ALWAYS_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwords",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "cookie",
        "cred",
        "creds",
        "pass",
        "passcode",
        "apikey",
        "accesskey",
        "privatekey",
        "secretkey",
        "authtoken",
        "accesstoken",
    }
)
ALWAYS_PAIRS = frozenset(
    {
        ("api", "key"),
        ("access", "key"),
        ("private", "key"),
        ("secret", "key"),
        ("account", "key"),
        ("auth", "key"),
        ("master", "key"),
        ("sas", "key"),
        ("signing", "key"),
        ("session", "key"),
        ("client", "secret"),
        ("access", "token"),
        ("auth", "token"),
        ("session", "token"),
        ("refresh", "token"),
        ("bearer", "token"),
        ("hf", "token"),
        ("hub", "token"),
    }
)
# words that say so when the value looks like a key: ML has attention keys (--key-dim 64) and
# token counts (num_tokens=4096)
KEYLIKE_WORDS = frozenset(
    {"token", "tokens", "key", "keys", "auth", "pat", "sig", "signature", "private", "access", "dsn"}
)
# parts of a name, inside any word (MYCO_CREDS, DBPASSWORD, XAPIKEY): a secret's name whatever
# its spelling
ALWAYS_PARTS = (
    "secret",
    "passw",
    "passwd",
    "passcode",
    "passphrase",
    "cred",
    "apikey",
    "accesskey",
    "privatekey",
    "secretkey",
    "signingkey",
    "authtoken",
    "accesstoken",
    "sessiontoken",
    "refreshtoken",
)
# parts that make an environment variable's value a secret unless it is plainly not one (a
# flag, a number: TOKENIZERS_PARALLELISM=false, NCCL_IB_PKEY=0)
ENV_PARTS = ("key", "token", "pass", "auth", "pwd", "cookie", "private", "dsn")
_HARMLESS = re.compile(
    r"(?i)^(?:|true|false|yes|no|on|off|none|null|auto|[-+]?\d{1,10}(?:\.\d+)?(?:e[-+]?\d+)?)$"
)
# a value that is a random key by its shape alone: long, upper and lower case and digits mixed
# (a hex hash, a path, a model name or a UUID is not)
_RANDOM_KEY = re.compile(r"^(?=\S*[0-9])(?=\S*[a-z])(?=\S*[A-Z])[A-Za-z0-9+/_\-]{24,}={0,2}$")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
# a value that looks like a key: long, no spaces, not a path, letters and digits mixed
_KEYLIKE = re.compile(r"^(?![./~])(?=\S*[0-9])(?=\S*[A-Za-z])[A-Za-z0-9+=_\-.]{12,}$")

# values that are secrets wherever they appear: (pattern, the group that is the secret (0: all),
# lower-case texts one of which a match contains: a cheap test that skips the pattern on most lines)
# the word password (netrc's `password X`, prose `with password X`) before a value that is not a
# word (it holds a digit or a sign): `password reset` stays
_PASSWORD_WORD = re.compile(
    r"(?i)\b(password|passwd|passphrase|passcode)([ \t]+)(?=\S*[0-9_\-!@#$%^&*+=.])([^\s'\"]{6,})"
)
_USER_PASS = re.compile(r"(?<![\w-])(-u|--user|--proxy-user)([ \t]+|=)([^\s:'\"]+):([^\s'\"]+)")
_VALUE_PATTERNS = [
    # PEM private keys (multi-line when they come whole)
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.DOTALL),
        0,
        ("-----begin",),
    ),
    # scheme://user:password@host -> scheme://user:<redacted>@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s:/@]*):([^\s@/]+)@"), 3, ("://",)),
    # scheme://longkey@host (Sentry DSNs and friends): the user part is the key
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([A-Za-z0-9_\-]{16,})@"), 2, ("://",)),
    # connection strings and query strings: AccountKey=...;  ?sig=...&  password=...
    (
        re.compile(
            r"(?i)\b(AccountKey|SharedAccessKey|SharedAccessSignature|AccessKey|SecretKey|"
            r"ClientSecret|Password|Pwd|sig|api[_-]?key|access[_-]?token|auth[_-]?token|"
            r"token|secret)=([^;&\s\"']+)"
        ),
        2,
        ("=",),
    ),
    # netrc's `password X` and prose; curl's -u user:password
    (_PASSWORD_WORD, 3, ("pass",)),
    (_USER_PASS, 4, ("-u", "--user")),
    # HTTP authorisation headers
    (re.compile(r"(?i)\b(Bearer|Basic|token)\s+([A-Za-z0-9_\-.=+/]{16,})"), 2, ("bearer", "basic", "token")),
    # token shapes
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), 0, ("github_pat_",)),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), 0, ("gh",)),
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"), 0, ("glpat-",)),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), 0, ("hf_",)),
    (re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}"), 0, ("sk-",)),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), 0, ("xox",)),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), 0, ("akia", "asia")),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{35}\b"), 0, ("aiza",)),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), 0, ("eyj",)),
]
# a secret's name holds one of these (ALWAYS_WORDS, ALWAYS_PAIRS and KEYLIKE_WORDS all do)
_NAME_TRIGGERS = (
    "key",
    "token",
    "secret",
    "pass",
    "pwd",
    "cred",
    "cookie",
    "auth",
    "pat",
    "sig",
    "private",
    "access",
    "dsn",
)
# NAME=value in free text (a log line echoing `export WANDB_API_KEY=...`)
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*([^\s;&\"'=][^\s;&\"']*)")
# name: value / 'name': 'value' / "name": "value" / name = 'value' in free text (a config the
# job prints as a dict, JSON or YAML); a quoted value may hold spaces
_KEY_QUOTED = re.compile(
    r"""(?<![\w.\-])(["']?)([A-Za-z_][A-Za-z0-9_.\-]*)\1[ \t]*[:=][ \t]*(["'])(.*?)(?<!\\)\3"""
)
_KEY_BARE = re.compile(r"""(?<![\w.\-])(["']?)([A-Za-z_][A-Za-z0-9_.\-]*)\1[ \t]*:[ \t]+([^\s,;'"}\])]+)""")
_NO_VALUE = frozenset({"", "none", "null", "nil", "~", "true", "false", REDACTED.lower()})
# --option value / --option=value in free text (a log line echoing the job's arguments)
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9_\-]*)(=|[ \t]+)([^\s\"',]+)")


def name_words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(str(name)) if w]


def secret_name_strength(name: str) -> str | None:
    """'always' (any value is a secret), 'keylike' (a key-shaped value is), or None."""
    words = name_words(name)
    if any(w in ALWAYS_WORDS for w in words) or any(p in ALWAYS_PAIRS for p in zip(words, words[1:])):
        return "always"
    joined = "".join(words)
    if any(part in joined for part in ALWAYS_PARTS):
        return "always"
    if any(w in KEYLIKE_WORDS or w.endswith(("token", "tokens")) for w in words):
        return "keylike"
    return None


def is_harmless(value: object) -> bool:
    """A flag or a small number: no secret, whatever its name (TOKENIZERS_PARALLELISM=false)."""
    return bool(_HARMLESS.match(str(value).strip()))


def looks_random(value: object) -> bool:
    """A value that is a key by its shape alone (long, mixed case and digits)."""
    return bool(_RANDOM_KEY.match(str(value)))


def secret_env(name: str, value: object) -> bool:
    """An environment variable whose value is a secret: named like one (any spelling: *CRED*,
    *PASS*, *TOKEN*, *KEY*, *SECRET*, *AUTH*, ...) unless the value is a flag or a small
    number, or whatever its name when the value is a random key by its shape."""
    if secret_name_strength(name) == "always":
        return True
    joined = "".join(name_words(name))
    if (any(part in joined for part in ENV_PARTS) or secret_name_strength(name)) and not is_harmless(value):
        return True
    return isinstance(value, str) and looks_random(value)


def looks_like_key(value: str) -> bool:
    """Long, no spaces, not a path, letters and digits mixed: a token, a hex or base64 key."""
    return bool(_KEYLIKE.match(str(value)))


# options whose value is user:password (curl -u, wget --user, --proxy-user)
_USER_OPTIONS = frozenset({"-u", "--user", "--proxy-user", "-U"})


def _secret_value_for(name: str, value: Any) -> bool:
    if name in _USER_OPTIONS and ":" in str(value):
        return True
    strength = secret_name_strength(name)
    return strength == "always" or (strength == "keylike" and looks_like_key(value))


def _secret_pair(name: str, value: str) -> bool:
    """A name: value pair a job printed (a dict, JSON, YAML) that holds a secret."""
    if value.strip().lower() in _NO_VALUE:
        return False
    strength = secret_name_strength(name)
    if strength == "always":
        return True
    # named like a key or a token: anything but a flag, a number, a path or words
    return (
        strength == "keylike"
        and len(value) >= MIN_SECRET_CHARS
        and not (is_harmless(value) or "/" in value or any(c.isspace() for c in value))
    )


def _hide_pairs(text: str) -> str:
    text = _KEY_QUOTED.sub(lambda m: _hide_group(m, 4) if _secret_pair(m[2], m[4]) else m[0], text)
    return _KEY_BARE.sub(lambda m: _hide_group(m, 3) if _secret_pair(m[2], m[3]) else m[0], text)


def _hide_group(match: re.Match[str], group: int | str) -> str:
    if match[group] == REDACTED:
        return match[0]
    start, end = match.start(group) - match.start(), match.end(group) - match.start()
    return match[0][:start] + REDACTED + match[0][end:]


def redact_text(text: str) -> str:
    """Secrets found by their shape (and NAME=value pairs named like one) replaced."""
    if not text:
        return text
    text = str(text)
    lower = text.lower()
    for pattern, group, triggers in _VALUE_PATTERNS:
        if any(t in lower for t in triggers):
            text = pattern.sub(functools.partial(_hide_group, group=group), text)
    if not any(w in lower for w in _NAME_TRIGGERS):
        return text  # no NAME=value or --option value named like a secret can be in it
    text = _hide_pairs(text)
    text = _ASSIGNMENT.sub(
        lambda m: _hide_group(m, 2) if m[2] != REDACTED and _secret_value_for(m[1], m[2]) else m[0], text
    )
    return _OPTION.sub(
        lambda m: (
            f"{m[1]}{m[2]}{REDACTED}"
            if not m[3].startswith("-") and m[3] != REDACTED and _secret_value_for(m[1], m[3])
            else m[0]
        ),
        text,
    )


def redact_env(env: Mapping[str, Any] | None) -> dict[str, Any]:
    """{name: value} sorted by name; a secret's name hides its value, other values lose the
    secrets they contain (a password in DATABASE_URL)."""
    return {
        k: (REDACTED if secret_env(k, v) else redact_text(v) if isinstance(v, str) else v)
        for k, v in sorted((env or {}).items())
    }


def redact_argv(argv: Iterable[Any] | None) -> list[str]:
    """A command line with the values of secret options hidden: `--api-key=...`, `--hf-token X`,
    `--wandb_key <40 hex>`; and secrets inside any argument found by their shape."""
    out = []
    pending: str | None = None  # the option whose value is the next argument
    for arg in argv or []:
        arg = str(arg)
        if pending is not None:
            out.append(
                REDACTED if not arg.startswith("-") and _secret_value_for(pending, arg) else redact_text(arg)
            )
            pending = None
            continue
        if arg.startswith("-") and len(arg) > 1 and not arg.startswith("---"):
            name, eq, value = arg.partition("=")
            if eq:
                out.append(
                    f"{name}={REDACTED}" if _secret_value_for(name, value) else f"{name}={redact_text(value)}"
                )
                continue
            if secret_name_strength(name) or name in _USER_OPTIONS:
                pending = name
            out.append(arg)
            continue
        out.append(redact_text(arg))
    return out


def redact_value(value: Any, name: str | None = None) -> Any:
    """Any JSON-able value (options, nested dicts): secrets by name and by shape."""
    if (
        name is not None
        and isinstance(value, (str, int, float))
        and not isinstance(value, bool)
        and _secret_value_for(name, value)
    ):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value) and any(str(v).startswith("-") for v in value):
            return redact_argv(value)
        return [redact_value(v) for v in value]
    return value


# -- the secrets of one job, by value -------------------------------------------------------------
MIN_SECRET_CHARS = 6  # shorter values (HF_TOKEN=x, AUTH=1) would erase ordinary words and numbers


def _worth_hiding(value: object) -> bool:
    """A value to hide wherever it appears: long enough to be a secret, and not a path (PWD,
    OLDPWD are named like one)."""
    value = str(value)
    return (
        len(value) >= MIN_SECRET_CHARS
        and value != REDACTED
        and not value.startswith(("/", "~", "./", "../"))
        and value.strip() == value
    )


def secrets_in_text(text: object) -> list[str]:
    """The secret parts of a text found by their shape (a URL's password, a token)."""
    out = []
    for pattern, group, _ in _VALUE_PATTERNS:
        out += [m[group] for m in pattern.finditer(str(text)) if m[group] != REDACTED]
    for m in _ASSIGNMENT.finditer(str(text)):
        if _secret_value_for(m[1], m[2]):
            out.append(m[2])
    return out


def secret_values(env: Mapping[str, Any] | None = None, argv: Iterable[Any] | None = None) -> list[str]:
    """The secret values of a job: those of environment variables named like a secret, the
    secrets inside other variables (a password in DATABASE_URL), the values of options named like
    one (`--wandb_key KEY`, `--hf_token=...`) and token-shaped arguments."""
    values = []
    for name, value in (env or {}).items():
        if not isinstance(value, str) or not value:
            continue
        if secret_env(name, value) and (
            secret_name_strength(name) == "always" or not any(c.isspace() for c in value)
        ):  # hidden wherever it appears: a value with spaces must be named a secret outright
            values.append(value)
        else:
            values += secrets_in_text(value)
    pending: str | None = None
    for arg in argv or []:
        arg = str(arg)
        if pending is not None:
            if not arg.startswith("-") and _secret_value_for(pending, arg):
                values.append(arg)
            pending = None
        if arg.startswith("-") and len(arg) > 1:
            name, eq, value = arg.partition("=")
            if eq and _secret_value_for(name, value):
                values.append(value)
            elif not eq and secret_name_strength(name):
                pending = name
        values += secrets_in_text(arg)
    return values


class Redactor:
    """Hides one job's secrets wherever they appear: the values it was given (environment,
    arguments; see secret_values) verbatim, then every token shape (redact_text). What writes
    under a run folder (the launcher's log.txt, the shim's events) passes its text through one.

        r = Redactor.for_job(env, argv)
        r.line("args: ['--wandb_key', 'KEY']")  ->  "args: ['--wandb_key', '<redacted>']"
    """

    def __init__(self, values: Iterable[Any] = ()) -> None:
        known = sorted({str(v) for v in values if _worth_hiding(v)}, key=len, reverse=True)
        self.count = len(known)
        self.values = tuple(known)  # for a process that redacts the same way (the log relay)
        self._known = re.compile("|".join(map(re.escape, known))) if known else None

    @classmethod
    def for_job(cls, env: Mapping[str, Any] | None = None, argv: Iterable[Any] | None = None) -> Redactor:
        return cls(secret_values(env, argv))

    def line(self, text: str) -> str:
        """One line (or any text) with the known values and every secret shape hidden."""
        if not text:
            return text
        text = str(text)
        if self._known is not None:
            text = self._known.sub(REDACTED, text)
        return redact_text(text)

    __call__ = line

    def argv(self, argv: Iterable[Any] | None) -> list[str]:
        """A command line: options named like secrets (redact_argv), then the known values."""
        return [self.line(a) if a != REDACTED else a for a in redact_argv(argv)]

    def value(self, value: Any, name: str | None = None) -> Any:
        """Any JSON-able value (redact_value), then the known values in its strings."""
        value = redact_value(value, name)
        if isinstance(value, str):
            return self.line(value) if value != REDACTED else value
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value


_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")


class LineStream:
    """Lines of one stream (a job's stdout) redacted one by one, with what spans lines: the body
    of a private key printed line by line (BEGIN ... END) is hidden whole, not only its header."""

    def __init__(self, redact_line: Callable[[str], str]) -> None:
        self.redact_line = redact_line
        self.in_key = False

    def line(self, text: str) -> str:
        if self.in_key:
            end = _PEM_END.search(text)
            if end:
                self.in_key = False
                return REDACTED + self.redact_line(text[end.end() :])
            return REDACTED
        begin = _PEM_BEGIN.search(text)
        if begin and not _PEM_END.search(text, begin.end()):
            self.in_key = True
            return self.redact_line(text[: begin.start()]) + REDACTED
        return self.redact_line(text)


def _argv_lists(value: Any) -> Iterable[list[str]]:
    """Every list of strings inside a JSON-able value (the command lines a document holds)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _argv_lists(v)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            yield list(value)
        else:
            for v in value:
                yield from _argv_lists(v)


def redact_document(value: Any, env: Mapping[str, Any] | None = None) -> Any:
    """A document traindx writes outside a run's own recorder (fix.json, a comparison): the
    secrets of the environment it ran in and of every command line it holds hidden wherever they
    appear, then every secret by name and by shape (Redactor.value)."""
    values = secret_values(env)
    for argv in _argv_lists(value):
        values += secret_values(None, argv)
    return Redactor(values).value(value)
