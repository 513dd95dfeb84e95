"""The team-install files of infra/ hold together: the Compose file against the Compose Specification's
JSON schema and against what its users rely on (the image it builds, the env file, credentials, start
order, the Prefect pools), the Dockerfile against the repository, and the Kubernetes worker manifests
against the official Kubernetes models and the calls the training launcher makes.

Nothing here needs Docker or a cluster: no Compose plugin, daemon or API server runs on the test machines.
The schema is vendored in tests/data/ (see its README) because nothing can be downloaded at test time.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import json
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / "env.example"
DOCKERFILE = INFRA / "Dockerfile"
WORKER_MANIFEST = INFRA / "k8s" / "prefect-worker.yaml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"

# Environment keys whose values are credentials (the compose file may only interpolate them).
CREDENTIAL_KEY = re.compile(r"PASSWORD|SECRET|KEY", re.IGNORECASE)
# `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?error}`, `${NAME?error}`, `${NAME:+alt}`, `$$`.
REFERENCE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})")


# -- loading ----------------------------------------------------------------------------------------


@cache
def compose_text() -> str:
    return COMPOSE.read_text()


def compose() -> dict[str, Any]:
    """The compose file as written (variables not substituted); YAML anchors and merge keys resolved."""
    return yaml.safe_load(compose_text())


@cache
def env_example() -> dict[str, str]:
    values = {}
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f"env.example:{number}: {line!r}"
        values[name] = value
    return values


def prefect_file() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def declared_pools() -> set[str] | None:
    """The work pools `mlstm-sentiment deploy` creates (`definitions.work_pools`), None if not declared."""
    pools = (prefect_file().get("definitions") or {}).get("work_pools")
    if pools is None:
        return None
    if isinstance(pools, Mapping):
        return {pool.get("name", key) if isinstance(pool, Mapping) else key for key, pool in pools.items()}
    return {pool["name"] for pool in pools}


@cache
def manifests() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(WORKER_MANIFEST.read_text()) if doc]


def manifest(kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in manifests() if doc["kind"] == kind]
    return found


# -- Compose variable substitution, as the Compose Specification describes it -----------------------------


def strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string value of a YAML tree, with where it is (mapping keys are not values)."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from strings(value, f"{path}[{index}]")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, arg = match["name"], match["op"], match["arg"]
        value = env.get(name)
        # With a colon, an empty value counts as unset.
        is_set = value is not None and (value != "" or not (op or "").startswith(":"))
        if op is None:
            return value or ""
        if op.endswith("-"):
            return value if is_set else arg  # type: ignore[return-value]
        if op.endswith("?"):
            if not is_set:
                raise KeyError(f"{name}: {arg}")
            return value  # type: ignore[return-value]
        return arg if is_set else ""  # ":+" / "+"

    return REFERENCE.sub(substitute, text)


def interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, Mapping):
        return {key: interpolated(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, env) for value in node]
    return node


def environment(service: Mapping[str, Any]) -> dict[str, Any]:
    """A service's environment, from either of its two forms (mapping, or list of KEY=VALUE)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return dict(env)


def command(service: Mapping[str, Any]) -> list[str]:
    value = service.get("command") or []
    return shlex.split(value) if isinstance(value, str) else list(value)


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# -- the Compose file -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    from jsonschema import Draft7Validator  # the schema's $schema is draft-07

    schema = json.loads(SCHEMA.read_text())
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema)


def _schema_errors(validator: Any, document: Any) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '<top>'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    ]


def test_compose_file_follows_the_compose_specification(compose_validator: Any) -> None:
    """As written and as Compose sees it after substituting infra/env.example's values."""
    assert _schema_errors(compose_validator, compose()) == []
    assert _schema_errors(compose_validator, interpolated(compose(), env_example())) == []


def test_the_schema_catches_mistakes(compose_validator: Any) -> None:
    """The vendored schema is the strict one: a misspelt key or an unknown condition fails."""
    broken = compose()
    broken["services"]["worker"]["depend_on"] = broken["services"]["worker"].pop("depends_on")
    broken["services"]["mlflow"]["depends_on"]["postgres"]["condition"] = "service_ready"
    errors = _schema_errors(compose_validator, broken)
    assert any("depend_on" in error for error in errors), errors
    assert any(error.startswith("services.mlflow.depends_on") for error in errors), errors


def test_services_build_the_image_from_infra_dockerfile_at_the_repository_root() -> None:
    built = {name: s["build"] for name, s in compose()["services"].items() if "build" in s}
    assert built, "no service builds the image"
    for name, build in built.items():
        assert isinstance(build, Mapping), f"{name}: build must name infra/Dockerfile, not only a context"
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context} is not the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, f"{name}: {build['dockerfile']}"
    # The services built from the one Dockerfile share one image name, so it is built once and tagged once.
    images = {compose()["services"][name].get("image") for name in built}
    assert len(images) == 1 and None not in images, images


def test_every_variable_is_in_env_example_and_credentials_are_required() -> None:
    used: dict[str, set[str]] = {}
    for where, value in strings(compose()):
        leftover = REFERENCE.sub("", value)
        assert "$" not in leftover, (
            f"{where}: write variables as ${{NAME}} (and a literal $ as $$): {value!r}"
        )
        for match in REFERENCE.finditer(value):
            if match["name"]:
                used.setdefault(match["name"], set()).add(match["op"] or "")
    missing = sorted(set(used) - set(env_example()))
    assert not missing, f"infra/env.example does not list {missing}"
    for name, ops in used.items():
        if CREDENTIAL_KEY.search(name) or name.startswith("MINIO_ROOT"):
            assert ops == {":?"}, f"{name} is a credential: use only ${{{name}:?message}}, never a default"
    # Every value env.example gives is one the file uses (no stale settings to confuse an operator).
    assert sorted(set(env_example()) - set(used)) == []


def test_no_credential_is_written_in_the_compose_file() -> None:
    for name, service in compose()["services"].items():
        for key, value in environment(service).items():
            if CREDENTIAL_KEY.search(key):
                assert re.fullmatch(r"\$\{[^}]+\}", str(value)), f"{name}: {key} must come from infra/.env"
    # A URL with a password: the password is a variable. With every variable set to a marker of its
    # own, a password that is no marker is one typed into compose.yaml itself.
    markers = {name: f"marker-{name.lower()}" for name in env_example()}
    for where, value in strings(interpolated(compose(), markers)):
        for url in re.findall(r"\b[a-z][a-z0-9+.-]*://\S+", value):
            password = urlsplit(url).password
            assert password is None or password in markers.values(), f"{where}: a password in {url!r}"
    # env.example is committed: it holds placeholders, never a real password or secret key.
    for key, value in env_example().items():
        if re.search(r"PASSWORD|SECRET", key):
            assert "change-me" in value, f"infra/env.example: {key} must be a change-me placeholder"


def test_credentials_stay_out_of_git_and_out_of_the_image() -> None:
    def patterns(path: Path) -> set[str]:
        lines = (line.strip() for line in path.read_text().splitlines())
        return {line.strip("/") for line in lines if line and not line.startswith("#")}

    assert "infra/.env" in patterns(ROOT / ".gitignore")
    assert "infra/.env" in patterns(ROOT / ".dockerignore")


def test_dependencies_exist_and_wait_for_readiness() -> None:
    services = compose()["services"]
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        assert isinstance(depends_on, Mapping), f"{name}: depends_on needs conditions, not a bare list"
        for target, spec in depends_on.items():
            assert target in services, f"{name} depends on {target}, which is not a service"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", f"{target} is a one-shot"
            # Long-running services are waited on until they answer, not merely started.
            assert condition != "service_started", f"{name} → {target}: wait for service_healthy"
    for name, service in services.items():
        if service.get("restart", "no") != "no":
            assert "healthcheck" in service, f"{name} runs for good: give it a healthcheck"


def test_volumes_are_declared_and_mounted_files_exist() -> None:
    spec = interpolated(compose(), env_example())
    declared = set(spec.get("volumes") or {})
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):
                if source.endswith((".sql", ".sh", ".conf")):
                    assert (COMPOSE.parent / source).is_file(), f"{name} mounts {source}: no such file"
            else:
                assert source in declared, f"{name} mounts volume {source}, not declared under volumes:"
    assert {"postgres-data", "minio-data"} <= declared


def test_services_reach_each_other_by_service_name() -> None:
    """Every URL in an environment or command names a service of this file (or the host itself), and the
    buckets the store and MLflow's artifacts use are the ones minio-init creates."""
    spec = interpolated(compose(), env_example())
    services = spec["services"]
    for name, service in services.items():
        for where, value in strings({"environment": environment(service), "command": command(service)}):
            for url in re.findall(r"\b[a-z][a-z0-9+]*://\S+", value):
                host = urlsplit(url).hostname
                if url.startswith("s3://") or host is None:
                    continue
                assert host in services or host in {"localhost", "127.0.0.1"}, f"{name}.{where}: {url}"
    worker = environment(services["worker"])
    assert worker["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["MLSTM_MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert worker["MLSTM_S3_ENDPOINT_URL"] == "http://minio:9000"
    created = set(re.findall(r"local/([a-z0-9.-]+)", " ".join(command(services["minio-init"]))))
    store_bucket = urlsplit(worker["MLSTM_STORE_URI"]).netloc
    artifacts_bucket = urlsplit(option(command(services["mlflow"]), "--artifacts-destination") or "").netloc
    assert {store_bucket, artifacts_bucket} <= created, (store_bucket, artifacts_bucket, created)


def test_worker_pools_and_deploy_match_prefect_yaml() -> None:
    services = compose()["services"]
    deploy = command(services["deploy"])
    assert deploy[:2] == ["mlstm-sentiment", "deploy"], deploy
    # It runs in the image's /app, so its deployment file is the repository's infra/prefect.yaml.
    assert option(deploy, "--file") in (None, "infra/prefect.yaml", "/app/infra/prefect.yaml")
    compose_pool = option(command(services["worker"]), "--pool")
    (k8s_container,) = manifest("Deployment")["spec"]["template"]["spec"]["containers"]
    k8s_pool = option(k8s_container["command"], "--pool")

    pools = declared_pools()
    if pools is None:
        pytest.skip("infra/prefect.yaml has no definitions.work_pools yet")
    assert compose_pool in pools, f"the compose worker polls {compose_pool}; prefect.yaml declares {pools}"
    assert k8s_pool in pools, f"the Kubernetes worker polls {k8s_pool}; prefect.yaml declares {pools}"
    for deployment in prefect_file()["deployments"]:
        assert deployment["work_pool"]["name"] in pools, f"{deployment['name']}: pool not declared"
    # Every declared pool has a worker in infra/, or its runs would wait forever.
    assert pools <= {compose_pool, k8s_pool}, f"no worker in infra/ polls {pools - {compose_pool, k8s_pool}}"


# -- the Dockerfile ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile() -> list[Instruction]:
    """The instructions, with continuation lines joined and comments dropped, as Docker reads them."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"
    return instructions


def copy_sources(instruction: Instruction) -> list[str]:
    args = json.loads(instruction.args) if instruction.args.startswith("[") else shlex.split(instruction.args)
    if any(arg.startswith("--from") for arg in args):
        return []  # from another stage or image, not from the build context
    return [arg for arg in args if not arg.startswith("--")][:-1]


def arg_defaults() -> dict[str, str]:
    return dict(i.args.partition("=")[::2] for i in dockerfile() if i.keyword == "ARG")


def test_dockerfile_copies_what_exists_and_what_pip_needs() -> None:
    copies = [i for i in dockerfile() if i.keyword in ("COPY", "ADD")]
    sources = [source for i in copies for source in copy_sources(i)]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    ignored = [
        line.strip().strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source in sources:
        hit = [p for p in ignored if fnmatch.fnmatch(source.rstrip("/"), p)]
        assert not hit, f"COPY {source}, but .dockerignore drops it ({hit})"
    # `pip install .` needs the packages pyproject.toml names, its readme and the constraints.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {source.rstrip("/") for source in sources}
    packages = {name.split(".")[0] for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {*packages, pyproject["project"]["readme"], "constraints.txt"}
    assert needed <= copied, f"not copied: {needed - copied}"
    assert "team" in pyproject["project"]["optional-dependencies"]
    assert dockerfile()[0] == Instruction("FROM", "python:3.11-slim")


def test_dockerfile_installs_torch_from_the_spec_before_the_package() -> None:
    instructions = dockerfile()
    torch_pin = next(
        line.strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("torch")
    )
    # The default image is the CPU build the tests run on: the build arg's default is the pinned one.
    assert arg_defaults()["TORCH_SPEC"] == torch_pin
    assert "download.pytorch.org/whl/cpu" in arg_defaults()["TORCH_INDEX_URL"]

    runs = [(index, i.args) for index, i in enumerate(instructions) if i.keyword == "RUN"]
    torch_install = [i for i, args in runs if re.search(r"pip install \S*\$\{?TORCH_SPEC", args)]
    package_install = [i for i, args in runs if ".[team]" in args]
    assert len(torch_install) == 1 and len(package_install) == 1, runs
    first_copy = next(index for index, i in enumerate(instructions) if i.keyword == "COPY")
    # torch first, before the sources, so its layer survives code changes; then the package over it.
    assert torch_install[0] < first_copy < package_install[0]
    assert "--extra-index-url" in instructions[torch_install[0]].args
    package = instructions[package_install[0]].args
    assert re.search(r"pip install -c \S*constraints\.txt", package), package
    assert "constraints.txt" in package and "${TORCH_SPEC}" in package, "pin torch to the build it has"


def test_dockerfile_runs_as_a_numeric_non_root_user_without_telemetry() -> None:
    instructions = dockerfile()
    user = [i.args for i in instructions if i.keyword == "USER"][-1]
    uid = user.partition(":")[0]
    # Kubernetes can only check runAsNonRoot for a numeric user.
    assert uid.isdigit() and int(uid) != 0, user
    pod = manifest("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    env = dict(
        pair.partition("=")[::2] for i in instructions if i.keyword == "ENV" for pair in shlex.split(i.args)
    )
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    workdir = [i.args for i in instructions if i.keyword == "WORKDIR"][-1]
    assert workdir == "/app"
    # The launchers find their templates in the image's copy of infra/.
    assert env["MLSTM_INFRA_DIR"] == "/app/infra"


def test_dockerignore_keeps_local_state_out() -> None:
    lines = {line.strip().strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".mlstm-sentiment", ".git"} <= lines


# -- the Kubernetes worker --------------------------------------------------------------------------


def deserialize(document: Mapping[str, Any], model: str) -> Any:
    """The document as the Kubernetes client's model, as if the API server had answered it."""
    from kubernetes.client import ApiClient

    api, text = ApiClient(), json.dumps(document)
    if "content_type" in inspect.signature(api.deserialize).parameters:
        return api.deserialize(text, model, "application/json")
    return api.deserialize(SimpleNamespace(data=text), model)  # clients before 37 read response.data


@pytest.mark.parametrize("kind", ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment"])
def test_worker_manifest_matches_the_kubernetes_models(kind: str) -> None:
    """Every field is one Kubernetes knows, with the type it expects: a field the model does not know is
    dropped by the round trip, a wrong type or a missing required field fails to deserialize."""
    from kubernetes.client import ApiClient

    document = manifest(kind)
    model = deserialize(document, f"V1{kind}")
    assert type(model).__name__ == f"V1{kind}"
    assert ApiClient().sanitize_for_serialization(model) == document


def test_manifest_holds_only_those_kinds() -> None:
    assert sorted(doc["kind"] for doc in manifests()) == sorted(
        ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment"]
    )


def launcher_calls() -> set[str]:
    """The Kubernetes API methods tasks/jobs/launchers/kubernetes.py calls (``*_namespaced_*``)."""
    tree = ast.parse((ROOT / "tasks" / "jobs" / "launchers" / "kubernetes.py").read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and re.fullmatch(r"(create|get|list|read|delete|patch|replace|watch)_namespaced_\w+", node.func.attr)
    }


def test_role_grants_what_the_launcher_calls() -> None:
    from tasks.jobs.launchers.kubernetes import GROUP, PLURAL

    # API method → (API group, resource, RBAC verb) it needs.
    needs = {
        "create_namespaced_custom_object": (GROUP, PLURAL, "create"),
        "get_namespaced_custom_object": (GROUP, PLURAL, "get"),
        "list_namespaced_custom_object": (GROUP, PLURAL, "list"),
        "patch_namespaced_custom_object": (GROUP, PLURAL, "patch"),
        "delete_namespaced_custom_object": (GROUP, PLURAL, "delete"),
        "read_namespaced_pod": ("", "pods", "get"),
        "list_namespaced_pod": ("", "pods", "list"),
        "read_namespaced_pod_log": ("", "pods/log", "get"),
    }
    calls = launcher_calls()
    assert calls, "found no API call in tasks/jobs/launchers/kubernetes.py"
    unknown = calls - set(needs)
    assert not unknown, (
        f"tasks/jobs/launchers/kubernetes.py calls {unknown}: add what they need here and to the Role"
    )

    granted = {
        (group, resource, verb)
        for rule in manifest("Role")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    required = {needs[call] for call in calls}
    assert required <= granted, f"the Role lacks {required - granted}"
    # And nothing broad: no wildcards, no access to Secrets.
    assert not any("*" in entry for entry in granted)
    assert not any(resource == "secrets" for _, resource, _ in granted)


def test_worker_identity_namespace_and_labels_agree() -> None:
    account, role, binding = manifest("ServiceAccount"), manifest("Role"), manifest("RoleBinding")
    config, deployment = manifest("ConfigMap"), manifest("Deployment")
    pod = deployment["spec"]["template"]

    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject == {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": account["metadata"]["namespace"],
    }
    # One namespace for all of it, and the training jobs go there too: the Role grants only there.
    namespaces = {doc["metadata"]["namespace"] for doc in manifests()}
    assert namespaces == {config["data"]["MLSTM_K8S_NAMESPACE"]}, namespaces

    # The label the training job template puts on its objects, so one selector finds them all.
    template = yaml.safe_load((INFRA / "k8s" / "pytorchjob.yaml").read_text().replace("${", "x{"))
    name_label = template["metadata"]["labels"]["app.kubernetes.io/name"]
    for doc in manifests():
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == name_label, doc["kind"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()

    (container,) = pod["spec"]["containers"]
    assert container["command"][:3] == ["prefect", "worker", "start"]
    assert option(container["command"], "--type") == "process"
    assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
    settings = config["data"]
    assert {
        "PREFECT_API_URL",
        "MLSTM_STORE_URI",
        "MLSTM_MLFLOW_TRACKING_URI",
        "MLSTM_S3_ENDPOINT_URL",
    } <= set(settings)
    assert all(isinstance(value, str) for value in settings.values()), "ConfigMap values are strings"


def test_no_secret_values_in_the_manifests() -> None:
    from tasks.jobs.launchers.kubernetes import is_credential

    assert not any(doc["kind"] == "Secret" for doc in manifests()), "a Secret's values belong in the cluster"
    config = manifest("ConfigMap")
    # MLSTM_K8S_SECRET is the Secret's name, not a credential.
    leaked = [key for key in config["data"] if is_credential(key) and key != "MLSTM_K8S_SECRET"]
    assert not leaked, f"credentials in the ConfigMap: {leaked}"
    (container,) = manifest("Deployment")["spec"]["template"]["spec"]["containers"]
    for entry in container.get("env", []):
        if is_credential(entry["name"]):
            assert "value" not in entry, f"{entry['name']}: take it from the Secret (valueFrom.secretKeyRef)"
    secrets = [source["secretRef"]["name"] for source in container["envFrom"] if "secretRef" in source]
    # The Secret the training pods read too (tasks/jobs/launchers/kubernetes.py, MLSTM_K8S_SECRET).
    assert secrets == [config["data"]["MLSTM_K8S_SECRET"]]
