"""Secrets out of everything traindx writes or shows: by the name they are stored under
(`HF_TOKEN`, `--wandb_key`) and by their value's shape wherever they appear (a password in a
database URL, an `AccountKey=` in a connection string, a Sentry DSN's key, a GitHub/Hugging Face/
OpenAI/Slack/AWS token, a JWT, a private key block).

One module for the manifest (env, command, options) and the report (command, env, log lines).
Non-secrets must survive: a URL without credentials, a path, a git commit hash, a learning rate,
`TOKENIZERS_PARALLELISM`, `--key-dim 64`.
"""
import re

REDACTED = "<redacted>"

# words in a name that say its value is a secret whatever it looks like
ALWAYS_WORDS = frozenset({"secret", "secrets", "password", "passwords", "passwd", "pwd",
                          "passphrase", "credential", "credentials", "cookie", "apikey",
                          "accesskey", "privatekey", "secretkey", "authtoken", "accesstoken"})
ALWAYS_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
                          ("account", "key"), ("auth", "key"), ("master", "key"), ("sas", "key"),
                          ("signing", "key"), ("session", "key"), ("client", "secret"),
                          ("access", "token"), ("auth", "token"), ("session", "token"),
                          ("refresh", "token"), ("bearer", "token"), ("hf", "token"),
                          ("hub", "token")})
# words that say so when the value looks like a key: ML has attention keys (--key-dim 64) and
# token counts (num_tokens=4096)
KEYLIKE_WORDS = frozenset({"token", "tokens", "key", "keys", "auth", "pat", "sig", "signature",
                           "private", "access", "dsn"})
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
# a value that looks like a key: long, no spaces, not a path, letters and digits mixed
_KEYLIKE = re.compile(r"^(?![./~])(?=\S*[0-9])(?=\S*[A-Za-z])[A-Za-z0-9+=_\-.]{16,}$")

# values that are secrets wherever they appear
_VALUE_PATTERNS = [
    # PEM private keys (multi-line when they come whole)
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)",
                re.DOTALL), REDACTED),
    # scheme://user:password@host -> scheme://user:<redacted>@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s:/@]*):([^\s@/]+)@"), rf"\1\2:{REDACTED}@"),
    # scheme://longkey@host (Sentry DSNs and friends): the user part is the key
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([A-Za-z0-9_\-]{16,})@"), rf"\1{REDACTED}@"),
    # connection strings and query strings: AccountKey=...;  ?sig=...&  password=...
    (re.compile(r"(?i)\b(AccountKey|SharedAccessKey|SharedAccessSignature|AccessKey|SecretKey|"
                r"ClientSecret|Password|Pwd|sig|api[_-]?key|access[_-]?token|auth[_-]?token|"
                r"token|secret)=([^;&\s\"']+)"), rf"\1={REDACTED}"),
    # HTTP authorisation headers
    (re.compile(r"(?i)\b(Bearer|Basic|token)\s+([A-Za-z0-9_\-.=+/]{16,})"), rf"\1 {REDACTED}"),
    # token shapes
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"), REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}"), REDACTED),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{35}\b"), REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), REDACTED),
]
# NAME=value in free text (a log line echoing `export WANDB_API_KEY=...`)
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=([^\s;&\"']+)")
# --option value / --option=value in free text (a log line echoing the job's arguments)
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9_\-]*)(=|[ \t]+)([^\s\"',]+)")


def name_words(name):
    return [w.lower() for w in _WORD_SPLIT.split(str(name)) if w]


def secret_name_strength(name):
    """'always' (any value is a secret), 'keylike' (a key-shaped value is), or None."""
    words = name_words(name)
    if any(w in ALWAYS_WORDS for w in words) or any(p in ALWAYS_PAIRS for p in zip(words, words[1:])):
        return "always"
    if any(w in KEYLIKE_WORDS for w in words):
        return "keylike"
    return None


def is_secret_name(name):
    """An environment variable named like a secret: its value is never shown."""
    return secret_name_strength(name) is not None


def looks_like_key(value):
    """Long, no spaces, not a path, letters and digits mixed: a token, a hex or base64 key."""
    return bool(_KEYLIKE.match(str(value)))


def _secret_value_for(name, value):
    strength = secret_name_strength(name)
    return strength == "always" or (strength == "keylike" and looks_like_key(value))


def redact_text(text):
    """Secrets found by their shape (and NAME=value pairs named like one) replaced."""
    if not text:
        return text
    text = str(text)
    for pattern, replacement in _VALUE_PATTERNS:
        text = pattern.sub(replacement, text)
    text = _ASSIGNMENT.sub(
        lambda m: f"{m[1]}={REDACTED}" if m[2] != REDACTED and _secret_value_for(m[1], m[2]) else m[0],
        text)
    return _OPTION.sub(
        lambda m: f"{m[1]}{m[2]}{REDACTED}" if not m[3].startswith("-") and m[3] != REDACTED
        and _secret_value_for(m[1], m[3]) else m[0], text)


def redact_env(env):
    """{name: value} sorted by name; a secret's name hides its value, other values lose the
    secrets they contain (a password in DATABASE_URL)."""
    return {k: (REDACTED if is_secret_name(k) else redact_text(v) if isinstance(v, str) else v)
            for k, v in sorted((env or {}).items())}


def redact_argv(argv):
    """A command line with the values of secret options hidden: `--api-key=...`, `--hf-token X`,
    `--wandb_key <40 hex>`; and secrets inside any argument found by their shape."""
    out = []
    pending = None  # the option whose value is the next argument
    for arg in argv or []:
        arg = str(arg)
        if pending is not None:
            out.append(REDACTED if not arg.startswith("-") and _secret_value_for(pending, arg)
                       else redact_text(arg))
            pending = None
            continue
        if arg.startswith("-") and len(arg) > 1 and not arg.startswith("---"):
            name, eq, value = arg.partition("=")
            if eq:
                out.append(f"{name}={REDACTED}" if _secret_value_for(name, value)
                           else f"{name}={redact_text(value)}")
                continue
            if secret_name_strength(name):
                pending = name
            out.append(arg)
            continue
        out.append(redact_text(arg))
    return out


def redact_value(value, name=None):
    """Any JSON-able value (options, nested dicts): secrets by name and by shape."""
    if name is not None and isinstance(value, (str, int, float)) and not isinstance(value, bool) \
            and _secret_value_for(name, value):
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
