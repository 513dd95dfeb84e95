"""The Kubernetes launcher against a fake API server at the HTTP boundary: a real kubernetes ApiClient
talks to a small HTTP server on loopback that implements the endpoints the launcher uses, records every
request and lets a test play the training operator (job conditions, the Master pod and its log).

`kubectl apply --dry-run=client` is not used: even with --validate=false kubectl asks an API server for
its discovery documents to recognise the kind, so offline it cannot check a PyTorchJob. The pod template
is checked against the Kubernetes models instead.
"""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tasks.jobs.launchers import launcher_for
from tasks.jobs.launchers.base import JobHandle, JobSpec, JobState, LaunchError
from tasks.jobs.launchers.kubernetes import MAX_NAME, KubernetesLauncher, is_credential, job_name
from tasks.pretrain.stage import JOB_MODULE

ROOT = Path(__file__).resolve().parents[1]
SECRET_VALUES = ("wJalrXUtnFEMI-very-secret", "session-token-value", "mlflow-password-value")
CORPUS = "s3://corpora/corpora/c0ffee/manifest.json"
PAPER_ARGS = ("--corpus", CORPUS, "--preset", "paper_4096", "--run-name", "Paper_4096 Run")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


class FakeKubernetes:
    """The state behind the fake API server: PyTorchJobs, pods with logs, and the requests it got."""

    JOBS = re.compile(r"/apis/kubeflow\.org/v1/namespaces/(?P<ns>[^/]+)/pytorchjobs(?:/(?P<name>[^/]+))?")
    PODS = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<pod>[^/]+)/log)?")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        # (namespace, pod) -> labels, log (None: the container is still waiting to start).
        self.pods: dict[tuple[str, str], tuple[dict[str, str], bytes | None]] = {}
        self.deleting: dict[tuple[str, str], int] = {}
        self.linger = 0  # how many GETs a deleted job still answers (its pods stopping)
        self.fail: tuple[int, str] | None = None  # the answer to the next request, whatever it is
        self.url = ""

    # What a test does as the training operator.
    def set_conditions(self, namespace: str, name: str, *types: str, message: str = "") -> None:
        """Conditions in order, the last true, the earlier ones as the operator leaves them."""
        conditions = [{"type": t, "status": "False", "reason": f"PyTorchJob{t}"} for t in types]
        conditions[-1].update(status="True", message=message)
        with self.lock:
            self.jobs[namespace, name]["status"] = {"conditions": conditions}

    def set_pod(self, namespace: str, pod: str, labels: dict[str, str], log: bytes | None) -> None:
        with self.lock:
            self.pods[namespace, pod] = (labels, log)

    def requests_to(self, method: str) -> list[Request]:
        return [r for r in self.requests if r.method == method]

    # The API server.
    def answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append(Request(method, path, query, body))
            if self.fail is not None:
                (code, message), self.fail = self.fail, None
                return code, _status(code, message)
            if match := self.JOBS.fullmatch(path):
                return self._jobs(method, match["ns"], match["name"], body)
            if (match := self.PODS.fullmatch(path)) and method == "GET":
                return self._pods(match["ns"], match["pod"], query)
            return 405, _status(405, f"the fake API server does not implement {method} {path}")

    def _jobs(self, method: str, namespace: str, name: str | None, body: Any) -> tuple[int, Any]:
        if method == "POST" and name is None:
            key = (namespace, body["metadata"]["name"])
            if key in self.jobs:
                return 409, _status(409, f'pytorchjobs.kubeflow.org "{key[1]}" already exists')
            self.jobs[key] = {**body, "metadata": {**body["metadata"], "uid": "u-1"}, "status": {}}
            return 201, self.jobs[key]
        key = (namespace, name or "")
        if key not in self.jobs:
            return 404, _status(404, f'pytorchjobs.kubeflow.org "{name}" not found')
        if method == "GET":
            if key in self.deleting:
                if self.deleting[key] == 0:
                    del self.jobs[key], self.deleting[key]
                    return 404, _status(404, f'pytorchjobs.kubeflow.org "{name}" not found')
                self.deleting[key] -= 1
            return 200, self.jobs[key]
        if method == "DELETE":
            if self.linger:
                self.jobs[key]["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
                self.deleting[key] = self.linger
                return 200, self.jobs[key]
            return 200, self.jobs.pop(key)
        return 405, _status(405, f"{method} on a PyTorchJob")

    def _pods(self, namespace: str, pod: str | None, query: dict[str, list[str]]) -> tuple[int, Any]:
        if pod is None:
            wanted = dict(term.split("=", 1) for term in query["labelSelector"][0].split(","))
            items = [
                {
                    "metadata": {"name": name, "namespace": ns, "labels": labels},
                    "status": {"phase": "Running"},
                }
                for (ns, name), (labels, _) in self.pods.items()
                if ns == namespace and wanted.items() <= labels.items()
            ]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if (namespace, pod) not in self.pods:
            return 404, _status(404, f'pods "{pod}" not found')
        log = self.pods[namespace, pod][1]
        if log is None:
            return 400, _status(
                400, f'container "pytorch" in pod "{pod}" is waiting to start: ContainerCreating'
            )
        return 200, log


def _status(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


class _Handler(http.server.BaseHTTPRequestHandler):
    fake: FakeKubernetes

    def _handle(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        code, payload = self.fake.answer(
            self.command, url.path, parse_qs(url.query), json.loads(raw) if raw else None
        )
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, bytes) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _handle

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    fake = FakeKubernetes()
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _api_client(url: str) -> Any:
    from kubernetes.client import ApiClient, Configuration

    return ApiClient(Configuration(host=url))


@pytest.fixture
def launcher(fake: FakeKubernetes, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesLauncher]:
    # The installed package has no infra/ beside it: point at the checkout's.
    monkeypatch.setenv("MLSTM_INFRA_DIR", str(ROOT / "infra"))
    client = _api_client(fake.url)
    yield KubernetesLauncher("ml", "registry.example/mlstm:1", "mlstm-creds", client, poll_seconds=0.01)
    client.close()


def _spec(nodes: int = 2, gpus: int = 8, env: dict[str, str] | None = None) -> JobSpec:
    return JobSpec(
        name="Paper_4096 Run",
        args=PAPER_ARGS,
        module=JOB_MODULE,
        nodes=nodes,
        nproc_per_node=max(gpus, 1),
        gpus_per_node=gpus,
        env=env or {},
    )


# ---------------------------------------------------------------------------------------------
# The manifest


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 0), (1, 8), (2, 8), (16, 8)])
def test_render_one_pod_per_node(launcher: KubernetesLauncher, nodes: int, gpus: int) -> None:
    job = launcher.render(_spec(nodes, gpus))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"] == "paper-4096-run"
    assert job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["labels"] == {
        "app.kubernetes.io/name": "mlstm-sentiment",
        "mlstm-sentiment/run": "paper-4096-run",
    }
    assert job["spec"]["nprocPerNode"] == str(max(gpus, 1))
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 0}

    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if nodes == 1:
        assert set(replicas) == {"Master"}
    else:
        assert replicas["Worker"]["replicas"] == nodes - 1
        assert replicas["Worker"]["template"] == replicas["Master"]["template"]
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        assert container["image"] == "registry.example/mlstm:1"
        assert container["resources"] == ({"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {})
        assert container["envFrom"] == [{"secretRef": {"name": "mlstm-creds", "optional": True}}]
        assert pod["terminationGracePeriodSeconds"] == launcher.grace_seconds
        assert replica["template"]["metadata"]["labels"]["mlstm-sentiment/run"] == "paper-4096-run"

        command = container["command"]
        assert command[:5] == ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(max(gpus, 1))]
        flags = dict(zip(command[1:11:2], command[2:11:2], strict=True))
        assert flags["--node-rank"] == "$(PET_NODE_RANK)"
        assert flags["--master-addr"] == "$(PET_MASTER_ADDR)"
        assert flags["--master-port"] == "$(PET_MASTER_PORT)"
        assert command[11:] == ["-m", "tasks.pretrain.train", *PAPER_ARGS]


def test_a_finetune_job_renders_as_a_pytorchjob_of_the_finetuning_module(
    launcher: KubernetesLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`finetune --launcher kubernetes` plans the same kind of job as pretraining: torchrun on every pod,
    running the fine-tuning module with the planned settings."""
    from finetune_helpers import early_byte_splits, tiny_checkpoint

    from tasks.finetune.config import FinetuneParams
    from tasks.finetune.stage import plan_job
    from tasks.settings import get_settings

    monkeypatch.setenv("MLSTM_HOME", str(tmp_path / "home"))
    checkpoint = tiny_checkpoint(tmp_path / "home" / "store")
    params = FinetuneParams(
        checkpoint=checkpoint,
        dataset=f"early={early_byte_splits(tmp_path / 'early')}",
        launcher="kubernetes",
        nodes=2,
        gpus_per_node=8,
        batch_size=16,
        run="ft-on-k8s",
    )
    planned = plan_job(params, get_settings())
    job = launcher.render(planned.spec)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 1)
    command = replicas["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert command[11:] == ["-m", "tasks.finetune.train", *planned.config.to_args()]
    assert planned.config.checkpoint in command and "--batch-size" in command


def test_the_checkpoint_key_reaches_pods_through_the_secret_only(
    launcher: KubernetesLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod cannot read this machine's key file: a Kubernetes job needs MLSTM_CHECKPOINT_KEY, which
    reaches the pods from the Secret, never as a value in the manifest. A local job's key is made
    under MLSTM_HOME before any rank starts."""
    from tasks.jobs.environment import job_environment
    from tasks.settings import get_settings
    from tasks.signing import key_file

    monkeypatch.setenv("MLSTM_HOME", str(tmp_path / "home"))
    key = "team-key-from-the-secret-store"
    monkeypatch.setenv("MLSTM_CHECKPOINT_KEY", key)
    env = job_environment(get_settings(), "kubernetes")
    assert key not in json.dumps(
        launcher.render(_spec(nodes=2, gpus=8, env={**env, "MLSTM_CHECKPOINT_KEY": key}))
    )
    monkeypatch.delenv("MLSTM_CHECKPOINT_KEY")
    with pytest.raises(
        ValueError, match=r"^--launcher kubernetes needs MLSTM_CHECKPOINT_KEY set here and in"
    ):
        job_environment(get_settings(), "kubernetes")
    assert not key_file(tmp_path / "home").exists()
    job_environment(get_settings(), "local")
    assert key_file(tmp_path / "home").stat().st_mode & 0o777 == 0o600


def test_pod_template_matches_the_kubernetes_models(launcher: KubernetesLauncher) -> None:
    """Every field of the pod template is one Kubernetes knows, with the type it expects."""
    from kubernetes.client import ApiClient, V1PodTemplateSpec

    job = launcher.render(_spec(nodes=2, gpus=8, env={"MLSTM_STORE_URI": "s3://store"}))
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    model = V1PodTemplateSpec.from_dict(template)
    assert ApiClient().sanitize_for_serialization(model) == template


def test_dollar_signs_in_job_arguments_survive_kubernetes_expansion(launcher: KubernetesLauncher) -> None:
    spec = JobSpec(name="r", args=("--note", "costs $(HOME) $5"), module=JOB_MODULE)
    command = launcher.render(spec)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert command[-2:] == ["--note", "costs $$(HOME) $$5"]


def test_job_names_are_dns_labels() -> None:
    assert job_name("Paper_4096 Run") == "paper-4096-run"
    assert job_name("2024-01-run") == "run-2024-01-run"
    assert job_name("--") == "run"
    long_a, long_b = job_name("x" * 80 + "a"), job_name("x" * 80 + "b")
    assert long_a != long_b
    for name in (long_a, long_b, job_name("A" * 200)):
        assert len(name) <= MAX_NAME
        assert len(f"{name}-worker-9999999") <= 63
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


def test_credentials_are_recognised_by_name() -> None:
    for name in (
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "MLFLOW_TRACKING_PASSWORD",
    ):
        assert is_credential(name), name
    for name in (
        "MLFLOW_TRACKING_TOKEN",
        "db_password",
        "OPENAI_API_KEY",
        "MY_SECRET",
        "MLSTM_CHECKPOINT_KEY",
    ):
        assert is_credential(name), name
    for name in ("MLSTM_STORE_URI", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "TOKENIZERS_PARALLELISM"):
        assert not is_credential(name), name


def test_missing_template_names_the_paths_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLSTM_INFRA_DIR", str(tmp_path))
    with pytest.raises(LaunchError, match=re.escape(str(tmp_path / "k8s" / "pytorchjob.yaml"))):
        KubernetesLauncher().render(_spec())


def test_launcher_needs_no_cluster_until_it_calls_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLSTM_K8S_NAMESPACE", "MLSTM_K8S_IMAGE", "MLSTM_K8S_SECRET"):
        monkeypatch.delenv(name, raising=False)
    launcher = launcher_for("kubernetes")
    assert isinstance(launcher, KubernetesLauncher)
    assert (launcher.namespace, launcher.image, launcher.secret) == (
        "default",
        "mlstm-sentiment:latest",
        "mlstm-sentiment",
    )
    monkeypatch.setenv("MLSTM_K8S_NAMESPACE", "training")
    assert KubernetesLauncher().namespace == "training"


def test_importing_the_launcher_does_not_import_kubernetes() -> None:
    code = "import sys, tasks.jobs.launchers.kubernetes; sys.exit('kubernetes' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------------------------
# Through the API server


def test_submit_posts_the_manifest_without_credentials(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    env = {
        "MLSTM_STORE_URI": "s3://store/prefix",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "AWS_SECRET_ACCESS_KEY": SECRET_VALUES[0],
        "AWS_SESSION_TOKEN": SECRET_VALUES[1],
        "MLFLOW_TRACKING_PASSWORD": SECRET_VALUES[2],
    }
    spec = _spec(nodes=4, gpus=8, env=env)
    handle = launcher.submit(spec)
    assert (handle.launcher, handle.job_id) == ("kubernetes", "ml/paper-4096-run")

    (post,) = fake.requests_to("POST")
    assert post.path == "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs"
    assert post.body == launcher.render(spec)
    sent = json.dumps(post.body)
    for value in SECRET_VALUES:
        assert value not in sent
    assert not any(name in sent for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PASSWORD"))
    for replica in post.body["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["env"] == [
            {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"},
            {"name": "MLSTM_STORE_URI", "value": "s3://store/prefix"},
        ]
        assert container["envFrom"] == [{"secretRef": {"name": "mlstm-creds", "optional": True}}]


def test_status_follows_the_conditions(fake: FakeKubernetes, launcher: KubernetesLauncher) -> None:
    handle = launcher.submit(_spec())
    assert launcher.status(handle).state is JobState.PENDING
    key = ("ml", "paper-4096-run")

    fake.set_conditions(*key, "Created", message="PyTorchJob paper-4096-run is created.")
    assert launcher.status(handle).state is JobState.PENDING
    fake.set_conditions(*key, "Created", "Running", message="PyTorchJob ml/paper-4096-run is running.")
    status = launcher.status(handle)
    assert (status.state, status.message) == (JobState.RUNNING, "PyTorchJob ml/paper-4096-run is running.")
    fake.set_conditions(*key, "Created", "Running", "Restarting")
    assert launcher.status(handle).state is JobState.RUNNING
    fake.set_conditions(*key, "Created", "Running", "Succeeded", message="done")
    assert launcher.status(handle) == launcher.wait(handle, poll_seconds=0.01)
    assert (launcher.status(handle).state, launcher.status(handle).exit_code) == (JobState.SUCCEEDED, 0)
    fake.set_conditions(*key, "Created", "Running", "Failed", message="1 Master replica(s) failed.")
    status = launcher.status(handle)
    assert (status.state, status.message) == (JobState.FAILED, "1 Master replica(s) failed.")

    assert all(
        r.path == "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs/paper-4096-run"
        for r in fake.requests_to("GET")
    )


def test_logs_read_the_master_pod_from_a_byte_offset(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    handle = launcher.submit(_spec())
    assert launcher.logs(handle) == ("", 0)  # no pod yet

    labels = {
        "training.kubeflow.org/job-name": "paper-4096-run",
        "training.kubeflow.org/replica-type": "master",
    }
    worker = {**labels, "training.kubeflow.org/replica-type": "worker"}
    fake.set_pod("ml", "paper-4096-run-worker-0", worker, b"worker noise\n")
    fake.set_pod("ml", "paper-4096-run-master-0", labels, None)
    assert launcher.logs(handle, 0) == ("", 0)  # container still starting

    fake.set_pod("ml", "paper-4096-run-master-0", labels, "step 1 loss 5.5 café\nstep 2".encode())
    text, offset = launcher.logs(handle, 0)
    assert (text, offset) == ("step 1 loss 5.5 café\n", len("step 1 loss 5.5 café\n".encode()))
    assert launcher.logs(handle, offset) == ("", offset)  # half a line waits for its end

    fake.set_pod("ml", "paper-4096-run-master-0", labels, "step 1 loss 5.5 café\nstep 2 loss 5.1\n".encode())
    text, end = launcher.logs(handle, offset)
    assert text == "step 2 loss 5.1\n"
    assert end == offset + len(text)

    lists = [r for r in fake.requests_to("GET") if r.path == "/api/v1/namespaces/ml/pods"]
    assert {r.query["labelSelector"][0] for r in lists} == {
        "training.kubeflow.org/job-name=paper-4096-run,training.kubeflow.org/replica-type=master"
    }
    reads = [r for r in fake.requests_to("GET") if r.path.endswith("/log")]
    assert {r.path for r in reads} == {"/api/v1/namespaces/ml/pods/paper-4096-run-master-0/log"}
    assert all(r.query["container"] == ["pytorch"] for r in reads)


def test_cancel_deletes_in_the_foreground_and_waits_for_the_pods(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    handle = launcher.submit(_spec())
    fake.set_conditions("ml", "paper-4096-run", "Created", "Running")
    fake.linger = 3  # the job answers three more GETs while its pods stop
    launcher.cancel(handle)

    (delete,) = fake.requests_to("DELETE")
    assert delete.path == "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs/paper-4096-run"
    assert delete.body == {"propagationPolicy": "Foreground", "gracePeriodSeconds": launcher.grace_seconds}
    assert len(fake.requests_to("GET")) == 4  # until the job was gone
    status = launcher.status(handle)
    assert status.state is JobState.CANCELLED

    launcher.cancel(handle)  # already gone: nothing to do
    assert len(fake.requests_to("DELETE")) == 2


def test_a_job_whose_pods_do_not_stop(fake: FakeKubernetes, launcher: KubernetesLauncher) -> None:
    handle = launcher.submit(_spec())
    fake.set_conditions("ml", "paper-4096-run", "Created", "Running")
    fake.linger = 1000  # say, a node that went away with its pod
    launcher.cancel_timeout = 0.05
    with pytest.raises(LaunchError, match=r"still being deleted after 0\.05 s: see kubectl get pods"):
        launcher.cancel(handle)
    status = launcher.status(handle)  # not finished while its pods may still run
    assert status.state is JobState.RUNNING
    assert "being deleted" in status.message


def test_submit_refuses_a_running_job_of_the_same_name(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    launcher.submit(_spec())
    fake.set_conditions("ml", "paper-4096-run", "Created", "Running")
    with pytest.raises(LaunchError, match=r"paper-4096-run .*running: cancel it .* or pick another --run"):
        launcher.submit(_spec())
    assert not fake.requests_to("DELETE")


def test_relaunch_replaces_the_ended_job_of_the_same_run(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    launcher.submit(_spec())
    fake.set_conditions("ml", "paper-4096-run", "Created", "Running", "Failed", message="preempted")
    handle = launcher.submit(_spec())
    assert launcher.status(handle).state is JobState.PENDING
    assert [r.method for r in fake.requests] == ["POST", "POST", "GET", "DELETE", "GET", "POST", "GET"]


def test_api_errors_name_the_server_and_the_operation(
    fake: FakeKubernetes, launcher: KubernetesLauncher
) -> None:
    handle = launcher.submit(_spec())
    fake.fail = (403, 'pods is forbidden: User "ci" cannot list resource "pods"')
    with pytest.raises(LaunchError) as error:
        launcher.logs(handle)
    message = str(error.value)
    assert fake.url in message
    assert "reading the log of PyTorchJob ml/paper-4096-run" in message
    assert 'HTTP 403 pods is forbidden: User "ci"' in message


def test_unreachable_server_names_its_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLSTM_INFRA_DIR", str(ROOT / "infra"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # nothing listens there now
    launcher = KubernetesLauncher(api_client=_api_client(url))
    with pytest.raises(LaunchError, match=re.escape(f"cannot reach the Kubernetes API server {url}")):
        launcher.submit(_spec())
    with pytest.raises(LaunchError, match="reading PyTorchJob default/x failed: cannot reach"):
        launcher.status(JobHandle("kubernetes", "default/x"))


def test_no_configuration_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kubernetes.config.kube_config as kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(
        LaunchError, match="no Kubernetes configuration: set KUBECONFIG or run inside a cluster"
    ):
        KubernetesLauncher().status(JobHandle("kubernetes", "default/x"))
