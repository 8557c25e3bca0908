"""The configuration machinery: frozen, typed sections parsed once at the edge (private).

This is the only module of kvconnect that reads environment variables. Each component has one
section, a frozen dataclass that lives beside its package (``kvconnect.transfer.config``,
``kvconnect.store.config``, ``kvconnect.sglang.config``, ``kvconnect.vllm.config``).
``from_mapping`` builds it from JSON-like data and rejects unknown keys listing the valid ones,
``from_env`` overlays ``KVCONNECT_<SECTION>_<FIELD>`` variables (and the shared
``KVCONNECT_TOKEN``, ``KVCONNECT_TOKEN_FILE`` and ``KVCONNECT_INSECURE``). An engine adapter's
section *embeds* the sections it configures (:class:`Composed`): users set them as a nested
mapping (``"store": {"replicas": 2}``), or through the adapter's flat keys that route to them
(:class:`Route`).

:func:`cluster_token` resolves the cluster token, generating one in a file only this user can
read when none is configured. It lives here rather than in ``kvconnect.auth`` because it is
configuration (settings, environment, files) that every layer needs, while ``auth`` derives
CurveZMQ keys for the zmq control planes and imports zmq, which the transfer layer must not
need.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Self, TypeVar

from kvconnect.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB

_C = TypeVar("_C")
_S = TypeVar("_S", bound="Section")
_E = TypeVar("_E", bound=enum.Enum)

log = logging.getLogger(__name__)

TOKEN_ENV = "KVCONNECT_TOKEN"  # noqa: S105 (a variable's name, not a secret)
TOKEN_FILE_ENV = "KVCONNECT_TOKEN_FILE"  # noqa: S105
AUTH_ENV = {TOKEN_ENV: "token", TOKEN_FILE_ENV: "token_file", "KVCONNECT_INSECURE": "insecure"}
"""The shared token variables → the field they set (sections that hold a token use them)."""

_SIZE_SUFFIX = {"K": KiB, "M": MiB, "G": MiB * 1024, "T": MiB * 1024 * 1024}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Section:
    """Parsing shared by the config classes: a mapping, or the environment.

    Every constructor funnels into :meth:`_build` with its layers, lowest precedence first.
    """

    __slots__ = ()
    _ENV_PREFIX: ClassVar[str]
    _SHARED_ENV: ClassVar[dict[str, str]] = {}  # variable → field, shared between sections

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        """Build from JSON-like data (no environment); unknown keys raise ConfigError listing
        the valid ones."""
        return cls._build([data], {})

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> Self:
        """``defaults`` (e.g. from a file), then ``<prefix><FIELD>`` variables (and shared
        ones), then ``overrides``: later sources win."""
        env = os.environ if environ is None else environ
        values = _env_section(cls, env)
        for variable, name in cls._SHARED_ENV.items():
            if variable in env and name not in values:
                values[name] = env[variable]
        return cls._build([defaults or {}, values, overrides], env)

    @classmethod
    def from_layers(
        cls, *layers: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> Self:
        """The environment, then each of ``layers`` in turn: later layers win (e.g. a file,
        then an engine's inline settings)."""
        env = os.environ if environ is None else environ
        return cls._build([_env_section(cls, env), *layers], env)

    @classmethod
    def valid_keys(cls) -> frozenset[str]:
        """The keys :meth:`from_mapping` accepts."""
        return frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def env_keys(cls) -> frozenset[str]:
        """The keys settable by ``<prefix><KEY>`` variables."""
        return cls.valid_keys()

    @classmethod
    def _build(cls, layers: Sequence[Mapping[str, Any]], environ: Mapping[str, str]) -> Self:
        """The section from ``layers`` merged key by key (later wins); ``environ`` is for the
        sections a :class:`Composed` embeds."""
        del environ  # a plain section has read its variables into a layer already
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer)
        return _from_mapping(cls, merged)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class Route(NamedTuple):
    """A flat key of an engine section that sets ``field`` of its embedded ``section``; the
    engine's ``default`` for it wins over that section's own default and variables."""

    section: str
    field: str
    default: Any


class Composed(Section):
    """A section that embeds others: each field typed as a section is built from the nested
    mapping of that name, the flat keys of ``_ROUTES`` that route to it (lower precedence
    first: its own ``<prefix><FIELD>`` variables, the routes' defaults, then the layers), so an
    engine adapter configures the store client or transfer engine without copying fields.

    One layer must not set a field both ways (``master`` and ``store.master``); across layers
    the later one wins, field by field.
    """

    __slots__ = ()
    _ROUTES: ClassVar[Mapping[str, Route]] = {}

    @classmethod
    def valid_keys(cls) -> frozenset[str]:
        """Own fields, embedded section names and routed keys."""
        return super().valid_keys() | frozenset(cls._ROUTES)

    @classmethod
    def env_keys(cls) -> frozenset[str]:
        """Own fields and routed keys (an embedded section reads its own variables)."""
        return cls.valid_keys() - frozenset(embedded_sections(cls))

    @classmethod
    def _build(cls, layers: Sequence[Mapping[str, Any]], environ: Mapping[str, str]) -> Self:
        sections = embedded_sections(cls)
        own: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for layer in layers:
            layer_own, layer_nested = cls._split(layer)
            own.update(layer_own)
            for name, values in layer_nested.items():
                nested[name].update(values)
        for name, section in sections.items():
            defaults = {r.field: r.default for r in cls._ROUTES.values() if r.section == name}
            try:
                own[name] = section.from_layers(defaults, nested[name], environ=environ)
            except ConfigError as exc:
                raise ConfigError(
                    f"{cls.__name__} section {name!r}{cls._hint(name)}: {exc}"
                ) from exc
        return _from_mapping(cls, own)

    @classmethod
    def _hint(cls, name: str) -> str:
        """Which flat keys set differently named fields of section ``name``, for errors."""
        renamed = [
            f"{key} sets {route.field}"
            for key, route in sorted(cls._ROUTES.items())
            if route.section == name and key != route.field
        ]
        return f" ({', '.join(renamed)})" if renamed else ""

    @classmethod
    def _split(cls, layer: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """One layer → (own fields, embedded section → its fields); raises ConfigError for an
        unknown key, a nested value that is not a mapping, or a field set both ways."""
        _reject_unknown(cls.__name__, layer, cls.valid_keys())
        sections = embedded_sections(cls)
        own = {k: v for k, v in layer.items() if k not in sections and k not in cls._ROUTES}
        nested: dict[str, dict[str, Any]] = {}
        for name in sections.keys() & layer.keys():
            if not isinstance(layer[name], Mapping):
                raise ConfigError(f"{name} must be a mapping of {sections[name].__name__} keys")
            nested[name] = dict(layer[name])
        for key in cls._ROUTES.keys() & layer.keys():
            route = cls._ROUTES[key]
            values = nested.setdefault(route.section, {})
            if route.field in values:
                raise ConfigError(f"set {key} or {route.section}.{route.field}, not both")
            values[route.field] = layer[key]
        return own, nested


def embedded_sections(cls: type) -> dict[str, type[Section]]:
    """The fields of ``cls`` typed as a section → that section's class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)
    }


def embedded_default(section: type[_S], routes: Mapping[str, Route], name: str) -> Callable[[], _S]:
    """The ``default_factory`` of embedded section ``name``: ``section`` with the routes'
    defaults (what :meth:`Composed.from_mapping` gives when nothing is set)."""
    defaults = {r.field: r.default for r in routes.values() if r.section == name}
    return functools.partial(section, **defaults)


def layered(
    cls: type[_S], inline: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> _S:
    """An engine adapter's settings: ``inline`` (the engine's extra-config) wins over the JSON
    file named ``config_file`` (inline or in the environment), which wins over the
    environment. Raises ConfigError for unknown keys, bad values or an unreadable file."""
    env = os.environ if environ is None else environ
    path = inline.get("config_file") or _env_section(cls, env).get("config_file", "")
    return cls.from_layers(_read_json_file(path), inline, environ=environ)


def _read_json_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the kvconnect config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings")
    return data


def default_token_file(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/kvconnect/token`` (``~/.config/kvconnect/token`` by default)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvconnect" / "token"


def cluster_token(
    token: str | None,
    token_file: str,
    insecure: bool,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The cluster token: ``token``, else the file ``token_file``, else ``KVCONNECT_TOKEN``,
    else the file ``KVCONNECT_TOKEN_FILE``, else the default token file
    (:func:`default_token_file`). With none of them, ``insecure`` gives None; otherwise a new
    token is generated into the default file (mode 0600) so that processes of this user on
    this host share it, and other hosts must be given it. Raises ConfigError for an unreadable
    or empty file."""
    env = os.environ if environ is None else environ
    if token:
        return token
    path = token_file or env.get(TOKEN_FILE_ENV, "")
    if not path and env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if path:
        return read_token_file(Path(path))
    default = default_token_file(env)
    if default.exists():
        return read_token_file(default)
    if insecure:
        return None
    return generate_token_file(default)


def tenant_token(cluster: str, tenant: str) -> str:
    """Tenant ``tenant``'s token, derived from the cluster token (docs/store.md, "Tenants"):
    whoever holds the cluster token can hand it out; a tenant's token reveals neither the
    cluster token nor another tenant's."""
    mac = hmac.new(cluster.encode(), b"kvconnect tenant " + tenant.encode(), hashlib.sha256)
    return f"kvt-{mac.hexdigest()}"


def read_token_file(path: Path) -> str:
    """The first line of ``path``; warns once when others may read the file."""
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster token file {path}: {exc}") from exc
    token = text.strip().partition("\n")[0].strip()
    if not token:
        raise ConfigError(f"the cluster token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and path not in _WARNED:
        _WARNED.add(path)
        log.warning("cluster token file %s is readable by other users: chmod 600 it", path)
    return token


_WARNED: set[Path] = set()


def generate_token_file(path: Path) -> str:
    """Write a new random token to ``path`` (mode 0600; kept if another process was first)."""
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    except OSError as exc:
        raise ConfigError(
            f"no cluster token is configured and none could be generated at {path}: {exc}; "
            f"set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or insecure to run without one)"
        ) from exc
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    log.warning("generated a cluster token in %s (give it to the other hosts)", path)
    return token


def check_token(token: str | None) -> None:
    """ConfigError unless ``token`` is None or a non-empty string."""
    if token is not None and not token:
        raise ConfigError("token must be a non-empty string or None")


def check_positive(obj: object, *names: str) -> None:
    """ConfigError naming the first of the attributes ``names`` of ``obj`` that is not > 0."""
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


def check_nonnegative(obj: object, *names: str) -> None:
    """ConfigError naming the first of the attributes ``names`` of ``obj`` that is not >= 0
    (NaN included)."""
    for name in names:
        value = getattr(obj, name)
        if not value >= 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")


def check_choice(obj: object, name: str, kind: type[enum.Enum]) -> None:
    """Store attribute ``name`` of the frozen ``obj`` as a member of ``kind`` (a value given as
    its string becomes the member); ConfigError listing the choices otherwise."""
    object.__setattr__(obj, name, _choice(name, getattr(obj, name), kind))


def _choice(name: str, value: Any, kind: type[_E]) -> _E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise ConfigError(f"{name} must be one of {choices}; got {value!r}") from None


def _env_section(cls: type[Section], env: Mapping[str, str]) -> dict[str, Any]:
    """The ``<prefix><KEY>`` variables of ``cls`` as a layer; an unknown one of its prefix
    raises ConfigError listing the valid ones."""
    prefix = cls._ENV_PREFIX
    known = cls.env_keys()
    values: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name not in known:
            raise ConfigError(
                f"unknown environment variable {key}; valid: "
                + ", ".join(prefix + n.upper() for n in sorted(known))
            )
        values[name] = raw
    return values


def _reject_unknown(what: str, data: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown {what} key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )


def _from_mapping(cls: type[_C], data: Mapping[str, Any]) -> _C:
    hints = typing.get_type_hints(cls)
    known = frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    _reject_unknown(cls.__name__, data, known)
    kwargs = {name: _coerce(name, value, hints[name]) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert strings from the environment and check JSON values against the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("", "none"))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is tuple and args and isinstance(args[0], type) and issubclass(args[0], Section):
        return _sections(name, value, args[0])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _choice(name, value, hint)
    if hint is bool:
        return _coerce_bool(name, value)
    if hint in (int, float):
        return _coerce_number(name, value, hint)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _sections(name: str, value: Any, section: type[Section]) -> tuple[Section, ...]:
    """A field holding several sections: a list of mappings (or of sections), or its JSON
    text (the environment's and a flag's form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as exc:
            raise ConfigError(f"{name} must be a JSON list of mappings: {exc}") from exc
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name} must be a list of mappings, got {value!r}")
    out = []
    for item in value:
        if isinstance(item, section):
            out.append(item)
        elif isinstance(item, Mapping):
            try:
                out.append(section.from_mapping(item))
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from exc
        else:
            raise ConfigError(f"{name} must be a list of mappings, got an item {item!r}")
    return tuple(out)


def parse_size(text: str) -> int:
    """``4G``, ``512M``, ``64K``, a number: bytes (ConfigError otherwise)."""
    return int(_coerce_number("size", text, int))


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"{name} must be a boolean, got {value!r}")


def _coerce_number(name: str, value: Any, kind: type) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if isinstance(value, int | float) and (kind is float or isinstance(value, int)):
        return kind(value)  # type: ignore[no-any-return]
    if isinstance(value, str):
        text = value.strip()
        scale = _SIZE_SUFFIX.get(text[-1:].upper(), 1) if kind is int else 1
        try:
            return kind(text[:-1] if scale > 1 else text) * scale  # type: ignore[no-any-return]
        except ValueError:
            pass
    raise ConfigError(
        f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
    )
