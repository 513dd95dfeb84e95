"""The Kubernetes launcher: the training job as a Kubeflow Training Operator ``PyTorchJob``.

One pod per node, torchrun in each. The operator creates a Service for the Master pod and gives every pod
the rendezvous in its environment (``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NODE_RANK``); torchrun's
static rendezvous takes it from there. The Master is node rank 0, so it holds rank 0 and its log is the
job's log. Credentials never enter the manifest: the pods read them from a Secret.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import string
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import yaml

from tasks.jobs.launchers.base import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Launcher,
    LaunchError,
    infra_file,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
TEMPLATE = "k8s/pytorchjob.yaml"
CONTAINER = "pytorch"  # the operator requires this container name
# Labels the operator puts on the pods it creates.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
# Pods and Services are named <job>-worker-<index> and must stay within 63 characters.
MAX_NAME = 63 - len("-worker-") - 8

# Names of variables that hold credentials: they come from the Secret, never from the manifest.
# (TOKENIZERS_PARALLELISM is not one.) ACCESS_KEY also keeps AWS_ACCESS_KEY_ID out, so that the key id
# and its secret always come from the same place: an env entry would override the Secret's.
# CHECKPOINT_KEY: MLSTM_CHECKPOINT_KEY, the key checkpoints are signed with.
_CREDENTIAL = re.compile(
    r"PASSWORD|PASSWD|SECRET|TOKEN(?!IZER)|CREDENTIAL|ACCESS_KEY|API_KEY|PRIVATE_KEY|CHECKPOINT_KEY"
)

# The job's condition types (kubeflow.org/v1 JobConditionType) and what they mean here.
_STATES = {
    "Created": JobState.PENDING,
    "Suspended": JobState.PENDING,
    "Running": JobState.RUNNING,
    "Restarting": JobState.RUNNING,
    "Succeeded": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
}


def is_credential(name: str) -> bool:
    return _CREDENTIAL.search(name.upper()) is not None


def job_name(run: str) -> str:
    """A run name as a PyTorchJob name: a DNS-1035 label (the operator's rule), short enough for the pod
    names derived from it. A shortened name keeps a hash of the whole, so long run names stay distinct."""
    name = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"run-{name}".rstrip("-")
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(run.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - len(digest) - 1].rstrip('-')}-{digest}"
    return name


def job_status(job: Mapping[str, Any]) -> JobStatus:
    """A PyTorchJob's state from its conditions: the last one that is true wins."""
    current: Mapping[str, Any] | None = None
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in _STATES:
            current = condition
    if current is None:
        state, message = JobState.PENDING, "submitted, waiting for the training operator"
    else:
        state = _STATES[current["type"]]
        message = current.get("message") or current.get("reason") or current["type"]
    if (job.get("metadata") or {}).get("deletionTimestamp") and not state.finished:
        message = "being deleted: the pods have SIGTERM and are writing a checkpoint"
    return JobStatus(state, 0 if state is JobState.SUCCEEDED else None, message)


class KubernetesLauncher(Launcher):
    """Submits, watches and cancels PyTorchJobs through the Kubernetes API server."""

    name = "kubernetes"
    request_timeout = 30.0  # seconds per API call, so a hung server cannot hang the flow

    def __init__(
        self,
        namespace: str | None = None,
        image: str | None = None,
        secret: str | None = None,
        api_client: ApiClient | None = None,
        *,
        grace_seconds: int = 120,
        poll_seconds: float = 2.0,
    ) -> None:
        self.namespace = namespace or os.environ.get("MLSTM_K8S_NAMESPACE") or "default"
        self.image = image or os.environ.get("MLSTM_K8S_IMAGE") or "mlstm-sentiment:latest"
        self.secret = secret or os.environ.get("MLSTM_K8S_SECRET") or "mlstm-sentiment"
        # Time the ranks get between SIGTERM and SIGKILL to write a checkpoint.
        self.grace_seconds = grace_seconds
        # How long cancel waits for the pods to go: their grace period and a minute to be deleted.
        self.cancel_timeout = grace_seconds + 60.0
        self.poll_seconds = poll_seconds
        self._given_client = api_client

    # -- the manifest -------------------------------------------------------------------------------

    def render(self, spec: JobSpec) -> dict[str, Any]:
        """The PyTorchJob for a spec, from ``infra/k8s/pytorchjob.yaml``."""
        path = infra_file(TEMPLATE)
        name = job_name(spec.name)
        # torchrun is the container's first process: it gets the pod's SIGTERM and passes it to the ranks.
        torchrun = [
            "torchrun",
            "--nnodes", str(spec.nodes),
            "--nproc-per-node", str(spec.nproc_per_node),
            # Static rendezvous at the Master, from the variables the operator sets in every pod (Kubernetes
            # expands $(VAR)). The Master is node rank 0, so rank 0 and the job's log are there; c10d
            # would rank the nodes in the order of their host names instead.
            "--node-rank", "$(PET_NODE_RANK)",
            "--master-addr", "$(PET_MASTER_ADDR)",
            "--master-port", "$(PET_MASTER_PORT)",
        ]  # fmt: skip
        # "$$" is a literal "$" to that expansion, so the job's own arguments reach it unchanged.
        command = [*torchrun, *(arg.replace("$", "$$") for arg in spec.job_command())]
        left_out = sorted(key for key in spec.env if is_credential(key))
        if left_out:
            logger.info(
                "left out of the manifest, the pods get them from Secret %s: %s", self.secret, left_out
            )
        env = [
            {"name": key, "value": str(value)}
            for key, value in sorted(spec.env.items())
            if key not in left_out
        ]
        resources = {"limits": {"nvidia.com/gpu": str(spec.gpus_per_node)}} if spec.gpus_per_node else {}
        values = {
            "name": name,
            "namespace": self.namespace,
            "image": self.image,
            "secret": self.secret,
            "nproc_per_node": str(spec.nproc_per_node),
            "num_workers": spec.nodes - 1,
            "grace_seconds": self.grace_seconds,
            "command": command,
            "env": env,
            "resources": resources,
        }
        try:
            text = string.Template(path.read_text()).substitute({k: json.dumps(v) for k, v in values.items()})
            manifest = yaml.safe_load(text)
        except (KeyError, ValueError, yaml.YAMLError) as error:
            raise LaunchError(f"cannot render {path}: {error!r}") from error
        # Through JSON: plain dicts, no longer sharing the pod template between Master and Worker.
        manifest = json.loads(json.dumps(manifest))
        if spec.nodes == 1:
            del manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
        return manifest

    # -- the API ------------------------------------------------------------------------------------

    @cached_property
    def api_client(self) -> ApiClient:
        """The given client, else one from the kubeconfig, else from the pod's service account."""
        if self._given_client is not None:
            return self._given_client
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_kube_config(client_configuration=configuration)
        except config.ConfigException as kubeconfig_error:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException as error:
                raise LaunchError(
                    "no Kubernetes configuration: set KUBECONFIG or run inside a cluster "
                    f"(kubeconfig: {kubeconfig_error}; in-cluster: {error})"
                ) from error
        return client.ApiClient(configuration)

    @property
    def server(self) -> str:
        return str(self.api_client.configuration.host)

    def _custom(self) -> CustomObjectsApi:
        from kubernetes.client import CustomObjectsApi

        return CustomObjectsApi(self.api_client)

    def _core(self) -> CoreV1Api:
        from kubernetes.client import CoreV1Api

        return CoreV1Api(self.api_client)

    @contextmanager
    def _calling(self, operation: str) -> Iterator[None]:
        """API and connection errors as a LaunchError naming the server and the operation."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            yield
        except ApiException as error:
            if not error.status:  # the client's own failures (TLS) come without an HTTP status
                raise LaunchError(
                    f"{operation} failed: cannot reach the Kubernetes API server {self.server}: {error.reason}"
                ) from error
            raise LaunchError(
                f"{operation} failed on the Kubernetes API server {self.server}: "
                f"HTTP {error.status} {_server_message(error)}"
            ) from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise LaunchError(
                f"{operation} failed: cannot reach the Kubernetes API server {self.server}: {error}"
            ) from error

    def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The PyTorchJob, or None when there is none of that name."""
        from kubernetes.client.exceptions import ApiException

        with self._calling(f"reading PyTorchJob {namespace}/{name}"):
            try:
                job = self._custom().get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self.request_timeout
                )
                return cast("dict[str, Any]", job)  # the client types custom objects as `object`
            except ApiException as error:
                if error.status != 404:
                    raise
                return None

    def _create(self, manifest: dict[str, Any]) -> bool:
        """Create the PyTorchJob; False when one of that name exists."""
        from kubernetes.client.exceptions import ApiException

        namespace, name = self.namespace, manifest["metadata"]["name"]
        with self._calling(f"creating PyTorchJob {namespace}/{name}"):
            try:
                self._custom().create_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, manifest, _request_timeout=self.request_timeout
                )
            except ApiException as error:
                if error.status != 409:
                    raise
                return False
        return True

    # -- the launcher -------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobHandle:
        manifest = self.render(spec)
        name = manifest["metadata"]["name"]
        handle = JobHandle(self.name, f"{self.namespace}/{name}")
        if self._create(manifest):
            return handle
        existing = self._get(self.namespace, name)
        if existing is not None:
            state = job_status(existing).state
            if not (state.finished or existing["metadata"].get("deletionTimestamp")):
                raise self._conflict(name, f"is {state}")
            # An earlier attempt of this run that has ended (say, preempted): the relaunch takes its name
            # and resumes from its checkpoint.
            logger.info("replacing the %s PyTorchJob %s/%s", state, self.namespace, name)
            self.cancel(handle)
        if not self._create(manifest):
            raise self._conflict(name, "was created again meanwhile")
        return handle

    def _conflict(self, name: str, what: str) -> LaunchError:
        return LaunchError(
            f"a PyTorchJob named {name} already exists in namespace {self.namespace} and {what}: cancel it "
            f"(kubectl delete pytorchjob {name} -n {self.namespace}) or pick another --run"
        )

    def status(self, handle: JobHandle) -> JobStatus:
        namespace, name = self._locate(handle)
        job = self._get(namespace, name)
        if job is None:
            return JobStatus(JobState.CANCELLED, message=f"PyTorchJob {namespace}/{name} was deleted")
        return job_status(job)

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """The Master pod's log (rank 0) from byte ``offset`` on, whole lines only; nothing before it starts."""
        from kubernetes.client.exceptions import ApiException

        namespace, name = self._locate(handle)
        selector = f"{JOB_NAME_LABEL}={name},{REPLICA_TYPE_LABEL}=master"
        with self._calling(f"reading the log of PyTorchJob {namespace}/{name}"):
            pods = self._core().list_namespaced_pod(
                namespace, label_selector=selector, _request_timeout=self.request_timeout
            )
            if not pods.items:
                return "", offset
            try:
                response = self._core().read_namespaced_pod_log(
                    pods.items[0].metadata.name,  # type: ignore[union-attr,arg-type]  # a pod always has metadata
                    namespace,
                    container=CONTAINER,
                    _preload_content=False,  # bytes, so that offsets count bytes as read_log's do
                    _request_timeout=self.request_timeout,
                )
            except ApiException as error:
                # 400: the container has not started yet; 404: the pod went between the two calls.
                if error.status in (400, 404):
                    return "", offset
                raise
            log = response.data  # type: ignore[attr-defined]  # _preload_content=False: the raw response
        if len(log) < offset:
            offset = 0  # a shorter log is a new pod's (the job was replaced): read it from its start
        chunk = log[offset:]
        end = chunk.rfind(b"\n") + 1
        return chunk[:end].decode("utf-8", "replace"), offset + end

    def cancel(self, handle: JobHandle) -> None:
        """Delete the job and wait until its pods are gone; they get SIGTERM and checkpoint first.

        A job that has ended is deleted too, which frees its name for a relaunch of the same run.
        """
        from kubernetes.client import V1DeleteOptions
        from kubernetes.client.exceptions import ApiException

        namespace, name = self._locate(handle)
        # Foreground: the job object stays until its pods are gone, so "gone" means stopped. A custom
        # object has no graceful deletion of its own: the pods' terminationGracePeriodSeconds (the same
        # value, from the template) is what gives the ranks their time.
        options = V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=self.grace_seconds)
        with self._calling(f"deleting PyTorchJob {namespace}/{name}"):
            try:
                self._custom().delete_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    body=options,
                    _request_timeout=self.request_timeout,
                )
            except ApiException as error:
                if error.status != 404:
                    raise
                return
        deadline = time.monotonic() + self.cancel_timeout
        while self._get(namespace, name) is not None:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"PyTorchJob {namespace}/{name} is still being deleted after {self.cancel_timeout:g} s: "
                    f"see kubectl get pods -n {namespace} -l {JOB_NAME_LABEL}={name}"
                )
            time.sleep(self.poll_seconds)

    def _locate(self, handle: JobHandle) -> tuple[str, str]:
        namespace, _, name = handle.job_id.partition("/")
        if handle.launcher != self.name or not name:
            raise LaunchError(f"job {handle.job_id!r} of launcher {handle.launcher!r} is not a PyTorchJob")
        return namespace, name


def _server_message(error: Exception) -> str:
    """The message of the Status object the API server answers errors with, else the HTTP reason."""
    body = getattr(error, "body", None)
    try:
        return str(json.loads(body)["message"])  # type: ignore[arg-type]  # None: TypeError, caught
    except (TypeError, ValueError, KeyError):
        return str(getattr(error, "reason", "") or body or "")
