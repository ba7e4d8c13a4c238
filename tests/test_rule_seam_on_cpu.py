"""The rule seam keeps each rule in one place: a rule's registered name (as a string in code) and its own knobs
(its Knobs fields beyond the shared ranking) stand only in its module and in the preset table, in the product's
``.py`` files (``core/``, ``verl_glue/``, ``plugin.py``, ``main_ppo.py``); prose may still name it. So a new rule is
one module of ``core/rules/``, one preset line and its tests (ARCHITECTURE.md, "Where a new thing goes")."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from verl_tokensel.core.seam.loss_modes import LOSS_MODES
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY
from verl_tokensel.core.seam.knobs import knob_fields

PACKAGE = Path(__file__).resolve().parents[1] / "verl_tokensel"
PRODUCT = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).parts[0] in ("core", "verl_glue", "plugin.py", "main_ppo.py"))
PRESETS_FILE = PACKAGE / "core" / "resolve" / "presets.py"
LOSS_MODES_FILE = PACKAGE / "core" / "seam" / "loss_modes.py"
COMPONENTS = {**{("rule", n): (r, knob_fields(r.Knobs)) for n, r in RULE_REGISTRY.items()},
              **{("shaping", n): (s, dataclasses.fields(s.Knobs)) for n, s in SHAPING_REGISTRY.items()}}


def files_naming(name: str, knobs: list[str]) -> dict[str, list[str]]:
    """The product files where ``name`` stands as a string literal or a knob as a word, and which of them."""
    patterns = [(name, re.compile(rf"""["']{re.escape(name)}["']"""))]
    patterns += [(k, re.compile(rf"\b{re.escape(k)}\b")) for k in knobs]
    out: dict[str, list[str]] = {}
    for path in PRODUCT:
        text = path.read_text(encoding="utf-8")
        found = [word for word, pat in patterns if pat.search(text)]
        if found:
            out[path.relative_to(PACKAGE).as_posix()] = found
    return out


@pytest.mark.parametrize("kind,name", sorted(COMPONENTS), ids=lambda v: str(v))
def test_a_rule_stands_in_its_module_and_the_preset_table_only(kind, name):
    component, own = COMPONENTS[(kind, name)]
    module = Path(inspect.getfile(type(component))).resolve()
    if PACKAGE not in module.parents:  # a rule registered by a test or user code
        pytest.skip(f"{kind} {name} is not the package's")
    where = files_naming(name, [f.name for f in own])
    allowed = {module.relative_to(PACKAGE).as_posix(), PRESETS_FILE.relative_to(PACKAGE).as_posix()}
    if name in LOSS_MODES:  # verl's policy loss of that name (kl_cov, clip_cov) in the table of verl's losses
        allowed.add(LOSS_MODES_FILE.relative_to(PACKAGE).as_posix())
    assert set(where) <= allowed, f"{kind} {name} stands outside its module and the preset table: {where}"


def test_the_shared_config_holds_only_what_every_rule_shares():
    """At most 12 shared fields (rule, knobs, score source, scope, ...); a rule's own knobs live in its Knobs."""
    from verl_tokensel.core.resolve.selection import Selection

    shared = [f.name for f in dataclasses.fields(Selection)]
    assert len(shared) <= 12, shared
    own = {f.name for _, fields in COMPONENTS.values() for f in fields}
    assert not own & set(shared), own & set(shared)


#: the public module's names beyond the first ten, each what a built-in rule needed that the ten lacked
ADDED_NAMES = {
    "Ranking": "the ranking knobs (score, ratio, direction, pool, budget), only for the rules that rank",
    "Pool": "exact sums, counts and top-k over the data-parallel ranks (KL-Cov, Clip-Cov, STAPO, M2PO)",
    "register_score": "a rule's own per-token score, measured by the driver or the pre-pass (6 built-in rules)",
    "VocabStat": "a per-token reduction over the vocabulary in verl's old-log-prob pass or the update forward "
                 "(Lp-Reg's min-p proxy, SimKO's top-k log-probs)",
}


def test_a_rule_author_imports_one_module_of_at_most_fourteen_names():
    """``verl_tokensel.rules`` is the whole seam a rule author meets: the ten names plus those the built-in rules
    needed (:data:`ADDED_NAMES`), each importable, and the example rule in user code imports nothing else of the
    package."""
    import ast

    import verl_tokensel.rules as public

    assert len(public.__all__) <= 10 + len(ADDED_NAMES), public.__all__
    assert set(ADDED_NAMES) <= set(public.__all__)
    assert all(hasattr(public, name) for name in public.__all__)
    example = Path(__file__).resolve().parents[1] / "examples" / "custom_rule.py"
    tree = ast.parse(example.read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    ours = [n.module for n in top if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("verl_tokensel")]
    assert ours == ["verl_tokensel.rules"], ours


def test_the_rule_base_class_is_small():
    """A rule's steps each take one input: the base class has at most 10 members of its own (name, knobs, needs,
    about and six steps), every step one argument besides self."""
    from verl_tokensel.rules import Rule

    own = {k for k in vars(Rule) if not k.startswith("__")} | set(Rule.__annotations__)
    assert len(own) <= 10, sorted(own)
    for name in ("score", "select", "transform", "stats", "check", "merge_passes"):
        params = list(inspect.signature(getattr(Rule, name)).parameters)
        assert len(params) == 2, (name, params)


def test_no_rule_loss_in_the_verl_glue():
    """One loss mechanism: a rule's per-token policy loss stands in its module (``LossTransform.token_loss``); the
    glue's policy-loss module only adapts it to verl's registry signature and aggregation."""
    import verl_tokensel.verl_glue.policy_loss as glue

    functions = {name for name, obj in vars(glue).items()
                 if inspect.isfunction(obj) and obj.__module__ == glue.__name__}
    assert functions == {"_bounds", "rule_token_loss", "transform_policy_loss", "register_policy_losses"}, functions
    text = inspect.getsource(glue)
    assert "torch.exp(" not in text and "torch.clamp(" not in text


def _project_imports(path: Path) -> set[str]:
    """The ``verl_tokensel`` modules a file imports (anywhere in it, lazy imports included)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl_tokensel"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("verl_tokensel"))
    return out


def test_every_built_in_rule_imports_only_the_public_module():
    """Each built-in rule module imports, of this project, only ``verl_tokensel.rules`` and helper modules (a
    family's shared maths) that themselves import only it: the public module is the one way to write a rule, and
    the 24 presets' rules prove it is enough."""
    import verl_tokensel.core.rules as builtin
    from verl_tokensel.core.rules import HELPERS, RULE_REGISTRY

    folder = Path(builtin.__file__).parent
    helpers = {f"verl_tokensel.core.rules.{name}" for name in HELPERS}
    allowed = {"verl_tokensel.rules", *helpers}
    for name in HELPERS:
        got = _project_imports(folder / f"{name}.py")
        assert got <= allowed, (name, got - allowed)
    modules = {type(rule).__module__ for rule in RULE_REGISTRY.values()
               if type(rule).__module__.startswith("verl_tokensel.core.rules.")}
    assert len(modules) == 15, sorted(modules)
    for module in sorted(modules):
        got = _project_imports(folder / f"{module.rsplit('.', 1)[1]}.py")
        assert "verl_tokensel.rules" in got, module
        assert got <= allowed, (module, got - allowed)


def test_provenance_is_one_data_file_for_every_built_in_component():
    """Each built-in rule's and shaping's source, formula and deviations stand in ``core/rules/provenance.toml``
    (none in the rule modules): an entry for each, none for anything else, and ``verl-tokensel rules`` reads it."""
    import tomllib

    from verl_tokensel.core.resolve.describe import about
    from verl_tokensel.core.rules import PROVENANCE, RULE_REGISTRY, SHAPING_REGISTRY

    data = tomllib.loads(PROVENANCE.read_text(encoding="utf-8"))
    builtin = {name for name, rule in RULE_REGISTRY.items()
               if type(rule).__module__.startswith("verl_tokensel.core.rules.")}
    assert set(data["rule"]) == builtin and set(data["shaping"]) == set(SHAPING_REGISTRY)
    for kind in ("rule", "shaping"):
        for name, entry in data[kind].items():
            assert entry["source"] and entry["formula"], (kind, name)
            assert about(kind, name).deviations == tuple(entry["deviations"]), (kind, name)
    for path in set(Path(PROVENANCE).parent.glob("*.py")) - {Path(PROVENANCE).with_name("__init__.py")}:
        assert "deviations=" not in path.read_text(encoding="utf-8"), path
