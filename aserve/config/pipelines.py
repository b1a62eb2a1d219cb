"""Checks of pipeline models against the rest of the config.

A pipeline's steps name other models of the same config; whether they exist,
whether each step finds the tensors it needs (with the right datatypes) and
whether the pipeline's outputs get produced can only be judged with the whole
config in hand, so these checks run after the schema is validated. Every
message starts with the JSON path of what to fix.

Layer ``config``: pure (no files, no engines), part of loading a config
(:func:`aserve.config.load.parse_config` calls :func:`check_pipelines`).
"""

from __future__ import annotations

from aserve.config.schema import ModelConfig, ServerConfig


def step_target(config: ServerConfig, name: str, version: str | None) -> ModelConfig | None:
    """The model a step calls: that version, or the highest one when none is named."""
    found = [m for m in config.models if m.name == name and version in (None, m.version)]
    return max(found, key=lambda m: int(m.version)) if found else None


def check_pipelines(config: ServerConfig) -> list[str]:
    """Problems with the config's pipelines, one line each (empty: none)."""
    problems: list[str] = []
    for i, model in enumerate(config.models):
        if model.engine == "pipeline":
            problems.extend(_check_one(config, i, model))
    problems.extend(_cycles(config))
    return problems


def _check_one(config: ServerConfig, i: int, model: ModelConfig) -> list[str]:
    problems: list[str] = []
    where = f"models[{i}]"
    # Tensors available so far: name -> (datatype, who made it).
    available = {s.name: (s.datatype, "the pipeline's inputs") for s in model.inputs}
    for j, step in enumerate(model.steps):
        at = f"{where}.steps[{j}]"
        target = step_target(config, step.model, step.version)
        if target is None:
            what = f"'{step.model}'" + (f" version '{step.version}'" if step.version else "")
            problems.append(f"{at}.model: no model {what} in this config")
            continue
        label = f"model '{target.name}'"
        in_specs = {s.name: s for s in target.inputs}
        out_specs = {s.name: s for s in target.outputs}
        for key in step.inputs:
            if key not in in_specs:
                problems.append(
                    f"{at}.inputs.{key}: {label} has no input '{key}' "
                    f"(inputs: {', '.join(in_specs)})"
                )
        for name, spec in in_specs.items():
            source = step.inputs.get(name, name)
            have = available.get(source)
            if have is None:
                problems.append(
                    f"{at}.inputs: {label} input '{name}' needs tensor '{source}', which "
                    f"neither the pipeline's inputs nor an earlier step provides "
                    f"(available: {', '.join(available)})"
                )
            elif have[0] != spec.datatype:
                problems.append(
                    f"{at}.inputs: tensor '{source}' is {have[0]} (from {have[1]}), but "
                    f"{label} input '{name}' takes {spec.datatype}"
                )
        for key in step.outputs:
            if key not in out_specs:
                problems.append(
                    f"{at}.outputs.{key}: {label} has no output '{key}' "
                    f"(outputs: {', '.join(out_specs)})"
                )
        published = step.outputs or {n: n for n in out_specs}
        for out_name, tensor in published.items():
            if out_name not in out_specs:
                continue
            if tensor in available:
                problems.append(
                    f"{at}.outputs: tensor '{tensor}' is already provided by "
                    f"{available[tensor][1]}; map {label} output '{out_name}' to another name"
                )
                continue
            available[tensor] = (out_specs[out_name].datatype, f"steps[{j}] ({target.name})")
    if problems:
        return problems
    for k, spec in enumerate(model.outputs):
        have = available.get(spec.name)
        if have is None:
            problems.append(f"{where}.outputs[{k}]: no step produces tensor '{spec.name}'")
        elif have[0] != spec.datatype:
            problems.append(
                f"{where}.outputs[{k}]: tensor '{spec.name}' is {have[0]} (from {have[1]}), "
                f"but the pipeline declares {spec.datatype}"
            )
    return problems


def _cycles(config: ServerConfig) -> list[str]:
    """A pipeline that reaches itself through its steps would never finish."""
    calls: dict[str, set[str]] = {}
    for m in config.models:
        if m.engine == "pipeline":
            calls.setdefault(m.name, set()).update(s.model for s in m.steps)
    problems = []
    for i, m in enumerate(config.models):
        if m.engine != "pipeline":
            continue
        seen: set[str] = set()
        todo = [s.model for s in m.steps]
        while todo:
            name = todo.pop()
            if name == m.name:
                problems.append(f"models[{i}].steps: pipeline '{m.name}' calls itself")
                break
            if name not in seen:
                seen.add(name)
                todo.extend(calls.get(name, ()))
    return problems
