"""A deployment's settings have one default each: the declaration's (``inference.settings``).

Every place a setting's default appears is held to it: the ``Deployment`` model's columns,
the deployment API's serializers, the role spec, the services' and the memory planner's
keyword defaults, and ``python -m inference generate``'s flags. The one exception is said
where it is made: the estimate simulates an int8 shadow unless told, because the simulator
has no model of a deployment's default fp32 shadow.
"""

from __future__ import annotations

import inspect

import pytest
from rest_framework import serializers
from rest_framework.fields import empty

from controlplane.deployments import api, services
from controlplane.deployments.models import SETTINGS_COLUMNS, Deployment
from inference.__main__ import GENERATE_SETTINGS, _parser
from inference.building import memory
from inference.runtime.spec import Addresses, RoleSpec
from inference.setting_flags import flag_of
from inference.settings import DEFAULTS, INFO, DeploymentSettings, markdown_table
from inference.sim.strategies.base import SIMULATED_SHADOW_DTYPE
from tests.paths import REPO

SERIALIZERS = {
    "suggest": api.SuggestApi.InputSerializer,
    "create": api.DeploymentListApi.InputSerializer,
    "settings": api.DeploymentSettingsApi.InputSerializer,
    "estimate": api.EstimateApi.InputSerializer,
}
# (where, setting) -> the default it has instead of the declaration's, and why.
EXCEPTIONS = {
    ("estimate", "shadow_dtype"): SIMULATED_SHADOW_DTYPE,  # the simulator models fp16, int8 and nf4 shadows only
    ("memory_from_config", "dtype"): None,  # the sized release's dtype on disk, not what roles compute in
}


def test_the_declaration_says_what_every_setting_accepts_and_means() -> None:
    for name, item in INFO.items():
        assert item.doc, name
        assert getattr(DEFAULTS, name) == item.default
        if item.choices:
            assert item.default in item.choices or (item.blank and item.default == ""), name
        if item.minimum is not None and item.default is not None:
            assert item.default >= item.minimum, name


def test_the_role_spec_is_the_declaration() -> None:
    assert DeploymentSettings is DeploymentSettings
    spec = RoleSpec(deployment="d", role="main", shard_dir="/x", addresses=Addresses("tcp://a:1", ["tcp://b:2"]))
    assert spec.settings == DEFAULTS


def test_every_settings_column_of_a_deployment_defaults_to_the_declaration() -> None:
    columns = [f for f in Deployment._meta.get_fields() if f.name in INFO]
    assert {f.name for f in columns} == set(SETTINGS_COLUMNS)  # what a role's spec takes from its deployment
    for column in columns:
        assert column.default == getattr(DEFAULTS, column.name), column.name
        if INFO[column.name].choices:
            assert {value for value, _ in column.choices} - {""} == set(INFO[column.name].choices), column.name


@pytest.mark.parametrize("where", sorted(SERIALIZERS))
def test_every_serializer_takes_a_setting_with_the_declared_default(where: str) -> None:
    fields = SERIALIZERS[where]().fields
    settings = [name for name in fields if name in INFO]
    assert settings, f"the {where} serializer takes no setting"
    for name in settings:
        field = fields[name]
        expected = EXCEPTIONS.get((where, name), getattr(DEFAULTS, name))
        if field.required:
            assert field.default is empty, (where, name)
        else:
            assert field.default == expected, (where, name)
        item = INFO[name]
        if isinstance(field, serializers.ChoiceField):
            assert tuple(field.choices) == item.choices, (where, name)
            assert field.allow_blank == item.blank, (where, name)
        if isinstance(field, serializers.IntegerField) and item.minimum is not None:
            assert field.min_value == item.minimum, (where, name)


SERVICES = [
    services.estimate,
    memory.memory_from_config,
]
# What takes a deployment's settings whole: their defaults are the declaration's by construction.
PLANNERS = [
    services.suggest_for,
    memory.memory_from_checkpoint,
    memory.memory_from_config,
    memory.plan_memory,
    memory.table,
]


@pytest.mark.parametrize("function", SERVICES, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_keyword_default_of_a_setting_is_the_declared_one(function) -> None:
    defaults = {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if name in INFO and p.default is not inspect.Parameter.empty
    }
    assert defaults, f"{function.__name__} takes no setting with a default"
    where = "estimate" if function is services.estimate else function.__name__
    for name, default in defaults.items():
        assert default == EXCEPTIONS.get((where, name), getattr(DEFAULTS, name)), (function.__name__, name)


def test_create_deployment_takes_the_setting_columns_by_name_and_spells_none_out() -> None:
    """Its settings are ``**settings``, each column's default the declaration's (``services``); the
    create API's serializer takes every column from ``fields.ColumnSettingsInput``."""
    parameters = inspect.signature(services.create_deployment).parameters
    assert parameters["settings"].kind is inspect.Parameter.VAR_KEYWORD
    assert not set(parameters) & set(INFO), "a setting spelled out beside **settings"
    assert set(SETTINGS_COLUMNS) <= set(SERIALIZERS["create"]().fields)


@pytest.mark.parametrize("function", PLANNERS, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_the_memory_planners_take_the_declared_settings_whole(function) -> None:
    parameters = inspect.signature(function).parameters
    assert parameters["settings"].default is DEFAULTS
    assert not set(parameters) & set(INFO) - {"dtype"}, "a setting spelled out beside the settings"


def test_the_cli_flags_of_generate_are_the_declarations() -> None:
    """Derived (``inference.setting_flags``): each setting's option, default, choices and help."""
    generate = _parser()._subparsers._group_actions[0].choices["generate"]
    actions = {a.dest: a for a in generate._actions}
    # Every flag named like a setting is one of those listed as setting it.
    assert {dest for dest in actions if dest in INFO} == set(GENERATE_SETTINGS)
    for name in GENERATE_SETTINGS:
        action, item = actions[name], INFO[name]
        assert action.default == getattr(DEFAULTS, name), name
        assert flag_of(name) in action.option_strings and item.doc.replace("%", "%%") in action.help, name
        if item.choices:
            assert set(action.choices) == set(item.choices) | ({""} if item.blank else set()), name
    assert flag_of("speculate") == "--no-speculate" and flag_of("hybrid") == "--hybrid"
    args = generate.parse_args(
        ["--model", "m", "--prompt", "p", "--max-new-tokens", "1", "--no-speculate", "--timeout", "9"]
    )
    assert (args.speculate, args.timeout_s, args.max_resident_experts) == (False, 9.0, DEFAULTS.max_resident_experts)


def test_the_docs_table_is_the_declarations() -> None:
    page = (REPO / "docs" / "deployment-settings.md").read_text()
    table = page.split("<!-- settings-table:start -->\n")[1].split("<!-- settings-table:end -->")[0]
    assert table == markdown_table(), "run python -m inference.settings and paste its table into the page"
