"""deploy/kubernetes/: every overlay renders, passes the Kubernetes schemas, and holds the
security properties docs/deployment.md promises, checked on the rendered objects. No cluster
is reachable here, so whatever only a cluster would catch is checked by hand: each Secret,
ConfigMap, Service and named port a workload uses exists in the rendered set."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from conftest import (
    AGENTS_NAMESPACE,
    DEPLOYMENT_DOC,
    KUSTOMIZE,
    MASTER_KEY,
    OVERLAYS,
    PG_PASSWORD,
    PROXY_NAMESPACE,
    SESSION_TOKEN,
    find,
    install_files,
    kustomize,
    pod_templates,
    secret_data,
)

from addon.launcher.launchenv import CA_VARS, NO_PROXY_VARS, PROXY_VARS

# The oldest and the newest schemas kubernetes-validate ships (1.25 and 1.37).
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
# Custom resources of the Prometheus Operator: no schema offline; checked below instead.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
AGENT_CA = "/etc/credproxy-ca/credproxy-ca.pem"

Objects = dict[str, list[dict[str, Any]]]


def workloads(rendered: Objects) -> list[Any]:
    return [
        pytest.param(overlay, name, id=f"{overlay}: {name}")
        for overlay in OVERLAYS
        for name, _ in pod_templates(rendered[overlay])
    ]


def template(rendered: Objects, overlay: str, name: str) -> dict[str, Any]:
    return dict(pod_templates(rendered[overlay]))[name]


def proxy_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment", "credproxy")


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [only] = workload["spec"]["template"]["spec"]["containers"]
    return only


def script(workload: dict[str, Any]) -> str:
    command = container(workload)["command"]
    assert command[:2] == ["sh", "-c"]
    return command[2]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- rendering and schemas -------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_the_kubernetes_schema(
    rendered: Objects, overlay: str, version: str
) -> None:
    kinds = set()
    for obj in rendered[overlay]:
        kinds.add(obj["kind"])
        if obj["kind"] in OPERATOR_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
    assert kinds & OPERATOR_KINDS == (OPERATOR_KINDS if overlay == "monitoring" else set())


def test_each_overlay_puts_everything_in_its_namespace(rendered: Objects) -> None:
    for overlay, namespace in [
        ("shared-proxy", PROXY_NAMESPACE),
        ("monitoring", PROXY_NAMESPACE),
        ("agents", AGENTS_NAMESPACE),
    ]:
        for obj in rendered[overlay]:
            if obj["kind"] == "Namespace":
                assert obj["metadata"]["name"] == namespace
            else:
                assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]


def test_both_namespaces_enforce_the_restricted_pod_security_profile(rendered: Objects) -> None:
    for overlay in OVERLAYS:
        [namespace] = [o for o in rendered[overlay] if o["kind"] == "Namespace"]
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted", overlay


# -- every pod, the proxy's, the init job's and the example agent's --------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "workload" in metafunc.fixturenames:
        names = [
            ("shared-proxy", "Deployment/credproxy"),
            ("shared-proxy", "Job/credproxy-init"),
            ("monitoring", "Deployment/credproxy"),
            ("monitoring", "Job/credproxy-init"),
            ("agents", "Deployment/agent"),
        ]
        metafunc.parametrize(
            "workload", names, ids=[f"{overlay}: {name}" for overlay, name in names]
        )


def test_the_listed_workloads_are_all_there_are(rendered: Objects) -> None:
    found = {
        (overlay, name) for overlay in OVERLAYS for name, _ in pod_templates(rendered[overlay])
    }
    assert found == {
        ("shared-proxy", "Deployment/credproxy"),
        ("shared-proxy", "Job/credproxy-init"),
        ("monitoring", "Deployment/credproxy"),
        ("monitoring", "Job/credproxy-init"),
        ("agents", "Deployment/agent"),
    }


def test_a_pod_runs_as_a_user_other_than_root(rendered: Objects, workload: tuple[str, str]) -> None:
    spec = template(rendered, *workload)["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    for c in spec["containers"] + spec.get("initContainers", []):
        assert c["securityContext"]["runAsNonRoot"] is True, c["name"]
        assert c["securityContext"].get("runAsUser", 1) != 0, c["name"]


def test_a_pod_has_a_read_only_root_file_system(
    rendered: Objects, workload: tuple[str, str]
) -> None:
    for c in template(rendered, *workload)["spec"]["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]


def test_a_pod_drops_every_capability_and_gains_none(
    rendered: Objects, workload: tuple[str, str]
) -> None:
    for c in template(rendered, *workload)["spec"]["containers"]:
        context = c["securityContext"]
        assert context["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert context["allowPrivilegeEscalation"] is False, c["name"]
        assert not context.get("privileged"), c["name"]


def test_a_pod_mounts_no_service_account_token(
    rendered: Objects, workload: tuple[str, str]
) -> None:
    assert template(rendered, *workload)["spec"]["automountServiceAccountToken"] is False


def test_a_pod_runs_under_the_runtime_default_seccomp_profile(
    rendered: Objects, workload: tuple[str, str]
) -> None:
    spec = template(rendered, *workload)["spec"]
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"]:
        assert c["securityContext"].get("seccompProfile", {"type": "RuntimeDefault"}) == {
            "type": "RuntimeDefault"
        }, c["name"]


def test_a_pod_shares_nothing_with_its_node(rendered: Objects, workload: tuple[str, str]) -> None:
    spec = template(rendered, *workload)["spec"]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(field), field
    assert not any("hostPath" in v for v in spec.get("volumes", []))


def test_a_pod_requests_and_limits_cpu_and_memory(
    rendered: Objects, workload: tuple[str, str]
) -> None:
    for c in template(rendered, *workload)["spec"]["containers"]:
        for bound in ("requests", "limits"):
            assert set(c["resources"][bound]) == {"cpu", "memory"}, (c["name"], bound)


def test_the_service_account_mounts_no_token(rendered: Objects) -> None:
    account = find(rendered["shared-proxy"], "ServiceAccount", "credproxy")
    assert account["automountServiceAccountToken"] is False


# -- the proxy -------------------------------------------------------------------------


def test_the_proxy_runs_several_replicas_that_a_drain_takes_one_at_a_time(
    rendered: Objects,
) -> None:
    objects = rendered["shared-proxy"]
    deployment = proxy_deployment(objects)
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = find(objects, "PodDisruptionBudget", "credproxy")
    assert budget["spec"]["maxUnavailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(budget["spec"]["selector"]["matchLabels"], labels)


def test_the_memory_limit_holds_the_connections_the_proxy_accepts(rendered: Objects) -> None:
    """A full proxy refuses connections (--max-connections) before it outgrows its memory
    limit, which would kill it and every connection with it: start-up on PostgreSQL, a busy
    connection each, and the AWS bodies held to be signed (docs/deployment.md's figures)."""
    deployment = proxy_deployment(rendered["shared-proxy"])
    found = re.search(r"--max-connections (\d+)", script(deployment))
    assert found is not None, "the default 4,096 busy connections outgrow a 640 MiB limit"
    limit = container(deployment)["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    needed = 130 * 1024 + int(found.group(1)) * 185 + 64 * 1024  # KiB
    assert needed <= int(limit.removesuffix("Mi")) * 1024 * 0.95, (needed // 1024, limit)


def test_the_probes_ask_the_admin_listener(rendered: Objects) -> None:
    deployment = proxy_deployment(rendered["shared-proxy"])
    proxy = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert f"--admin 0.0.0.0:{ports['admin']}" in script(deployment)
    assert f"--listen 0.0.0.0:{ports['proxy']}" in script(deployment)
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert proxy["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}


def test_the_store_url_carries_no_password(rendered: Objects) -> None:
    settings = find(rendered["shared-proxy"], "ConfigMap", "credproxy-settings")["data"]
    url = urlsplit(settings["CREDPROXY_DB"])
    assert url.scheme == "postgresql+psycopg"
    assert url.username and url.password is None


def test_no_secret_reaches_an_environment_variable_or_a_command_line(rendered: Objects) -> None:
    for overlay in ("shared-proxy", "monitoring"):
        objects = rendered[overlay]
        secrets = [v for o in objects if o["kind"] == "Secret" for v in secret_data(o).values()]
        assert secrets
        for name, pod in pod_templates(objects):
            for c in pod["spec"]["containers"]:
                for variable in c.get("env", []):
                    assert "valueFrom" not in variable, (name, variable["name"])
                    assert "MASTER_KEY" not in variable["name"], name
                assert all("secretRef" not in source for source in c.get("envFrom", [])), name
                visible = " ".join(c.get("command", []) + c.get("args", []))
                visible += " ".join(str(v.get("value")) for v in c.get("env", []))
                for secret in secrets:
                    for line in secret.decode().splitlines():
                        assert line.strip() not in visible, name
    assert MASTER_KEY.strip() and PG_PASSWORD  # the values searched for above are set


@pytest.mark.parametrize("name", ["Deployment/credproxy", "Job/credproxy-init"])
def test_secret_files_are_copied_private_before_credproxy_starts(
    rendered: Objects, name: str
) -> None:
    """kubelet's files are root's or group-readable: credproxy and libpq refuse those."""
    pod = template(rendered, "shared-proxy", name)
    [c] = pod["spec"]["containers"]
    lines = [line.strip() for line in c["command"][2].splitlines() if line.strip()]
    assert lines[:2] == ["set -eu", "umask 077"]
    env = {v["name"]: v["value"] for v in c["env"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    # Where the copies go: a memory-backed emptyDir, the only writable place beside /tmp.
    run = mounts["run"]["mountPath"]
    assert volumes["run"]["emptyDir"]["medium"] == "Memory"
    for variable in ("CREDPROXY_KEY_FILE", "PGPASSFILE", "CREDPROXY_CERTS"):
        assert env[variable].startswith(run + "/"), variable
    copies = [shlex.split(line) for line in lines if line.startswith("install -m")]
    assert all(words[:3] == ["install", "-m", "0600"] for words in copies)
    copied = {Path(source).name for words in copies for source in words[3:-1]}
    assert copied == {"credproxy.key", "pgpass", "mitmproxy-ca.pem", "credproxy-ca.pem"}
    assert {words[-1] for words in copies} == {
        "$CREDPROXY_KEY_FILE",
        "$PGPASSFILE",
        "$CREDPROXY_CERTS",
    }
    assert lines[-1].startswith("exec credproxy ")
    for volume in ("master-key", "store-password", "ca"):
        assert mounts[volume]["readOnly"] is True, volume
        assert "secret" in volumes[volume], volume


def test_the_mounted_secrets_hold_what_the_copies_expect(rendered: Objects) -> None:
    objects = rendered["shared-proxy"]
    key = secret_data(find(objects, "Secret", "credproxy-master-key"))
    assert key == {"credproxy.key": MASTER_KEY.encode()}
    password = secret_data(find(objects, "Secret", "credproxy-store-password"))
    assert password["pgpass"].decode().rstrip().endswith(f":{PG_PASSWORD}")
    ca = secret_data(find(objects, "Secret", "credproxy-ca"))
    assert set(ca) == {"mitmproxy-ca.pem", "credproxy-ca.pem"}


def test_the_ca_private_key_is_only_in_the_proxys_secret(rendered: Objects) -> None:
    holders = set()
    for overlay in OVERLAYS:
        for obj in rendered[overlay]:
            text = b"".join(secret_data(obj).values()) if obj["kind"] == "Secret" else b""
            text += yaml.safe_dump(obj).encode()
            if b"PRIVATE KEY" in text:
                name = re.sub(r"-[a-z0-9]{10}$", "", obj["metadata"]["name"])
                holders.add((overlay, obj["metadata"]["namespace"], obj["kind"], name))
    assert holders == {
        (overlay, PROXY_NAMESPACE, "Secret", "credproxy-ca")
        for overlay in ("shared-proxy", "monitoring")
    }


def test_only_the_init_job_migrates_and_it_runs_one_pod_at_a_time(rendered: Objects) -> None:
    objects = rendered["shared-proxy"]
    job = find(objects, "Job", "credproxy-init")
    assert job["spec"]["parallelism"] == 1
    assert job["spec"]["completions"] == 1
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert script(job).splitlines()[-1].strip() == "exec credproxy init"
    proxy_script = script(proxy_deployment(objects))
    assert "credproxy init" not in proxy_script
    assert proxy_script.splitlines()[-1].strip().startswith("exec credproxy run ")


def test_the_service_sends_to_the_proxies_alone(rendered: Objects) -> None:
    objects = rendered["shared-proxy"]
    service = find(objects, "Service", "credproxy")
    selector = service["spec"]["selector"]
    chosen = [
        name for name, pod in pod_templates(objects) if selects(selector, pod["metadata"]["labels"])
    ]
    assert chosen == ["Deployment/credproxy"]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8080, "proxy")]


def test_agent_namespaces_reach_the_proxy_port_and_nothing_else(rendered: Objects) -> None:
    objects = rendered["shared-proxy"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    [policy] = policies
    labels = proxy_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"credproxy.io/agents": "true"}}}]
    assert rule["ports"] == [{"port": "proxy", "protocol": "TCP"}]
    agents = find(rendered["agents"], "Namespace", AGENTS_NAMESPACE)
    assert agents["metadata"]["labels"]["credproxy.io/agents"] == "true"


# -- what a workload refers to exists --------------------------------------------------


def references(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """(kind, name) of every ConfigMap, Secret and ServiceAccount the pod uses."""
    spec = pod["spec"]
    found = set()
    if "serviceAccountName" in spec:
        found.add(("ServiceAccount", spec["serviceAccountName"]))
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            found.add(("Secret", volume["secret"]["secretName"]))
        if "configMap" in volume:
            found.add(("ConfigMap", volume["configMap"]["name"]))
    for c in spec["containers"] + spec.get("initContainers", []):
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                found.add(("Secret", source["secretRef"]["name"]))
            if "configMapRef" in source:
                found.add(("ConfigMap", source["configMapRef"]["name"]))
        for variable in c.get("env", []):
            for ref, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                if ref in variable.get("valueFrom", {}):
                    found.add((kind, variable["valueFrom"][ref]["name"]))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_config_map_and_account_a_pod_uses_is_rendered(
    rendered: Objects, overlay: str
) -> None:
    objects = rendered[overlay]
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for name, pod in pod_templates(objects):
        used = references(pod)
        assert used, name
        assert used <= present, (name, used - present)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_key_a_pod_mounts_is_in_its_secret_or_config_map(
    rendered: Objects, overlay: str
) -> None:
    objects = rendered[overlay]
    for name, pod in pod_templates(objects):
        for volume in pod["spec"].get("volumes", []):
            for kind, field, key in (
                ("Secret", "secret", "secretName"),
                ("ConfigMap", "configMap", "name"),
            ):
                if field not in volume:
                    continue
                source = next(
                    o
                    for o in objects
                    if o["kind"] == kind and o["metadata"]["name"] == volume[field][key]
                )
                keys = set(source.get("data", {}))
                assert {item["key"] for item in volume[field].get("items", [])} <= keys, name
                assert keys, (name, volume["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_and_budget_selects_pods_on_named_ports_they_have(
    rendered: Objects, overlay: str
) -> None:
    objects = rendered[overlay]
    pods = [pod for _, pod in pod_templates(objects)]
    for obj in objects:
        if obj["kind"] == "Service":
            chosen = [p for p in pods if selects(obj["spec"]["selector"], p["metadata"]["labels"])]
            assert chosen, obj["metadata"]["name"]
            for port in obj["spec"]["ports"]:
                for pod in chosen:
                    names = {
                        p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
                    }
                    assert port["targetPort"] in names, (obj["metadata"]["name"], port)
        if (
            obj["kind"] in ("PodDisruptionBudget", "NetworkPolicy")
            and obj["metadata"]["namespace"] == PROXY_NAMESPACE
        ):
            selector = obj["spec"].get("selector", obj["spec"].get("podSelector"))["matchLabels"]
            name = obj["metadata"]["name"]
            assert any(selects(selector, p["metadata"]["labels"]) for p in pods), name


def test_probes_and_policies_name_ports_the_proxy_has(rendered: Objects) -> None:
    objects = rendered["monitoring"]
    proxy = container(proxy_deployment(objects))
    names = {p["name"] for p in proxy["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert proxy[probe]["httpGet"]["port"] in names, probe
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= names, policy["metadata"]["name"]


# -- monitoring ------------------------------------------------------------------------


def test_the_service_monitor_scrapes_the_admin_port(rendered: Objects) -> None:
    objects = rendered["monitoring"]
    monitor = find(objects, "ServiceMonitor", "credproxy")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    [service] = [
        o
        for o in objects
        if o["kind"] == "Service"
        and selects(monitor["spec"]["selector"]["matchLabels"], o["metadata"].get("labels", {}))
    ]
    assert service["metadata"]["name"] == "credproxy-admin"
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["admin"]


def test_only_the_monitoring_namespace_reaches_the_admin_port(rendered: Objects) -> None:
    policies = [o for o in rendered["monitoring"] if o["kind"] == "NetworkPolicy"]
    opened = {
        (peer["namespaceSelector"]["matchLabels"].popitem(), port["port"])
        for policy in policies
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        for port in rule["ports"]
    }
    assert opened == {
        (("credproxy.io/agents", "true"), "proxy"),
        (("kubernetes.io/metadata.name", "monitoring"), "admin"),
    }


# -- the agents' side ------------------------------------------------------------------


def test_agent_pods_may_open_connections_only_to_the_proxy_and_dns(rendered: Objects) -> None:
    [policy] = [o for o in rendered["agents"] if o["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {}  # every pod in the namespace
    assert spec["policyTypes"] == ["Egress"]
    proxy_rule, dns_rule = spec["egress"]
    [proxy_peer] = proxy_rule["to"]
    assert proxy_peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": PROXY_NAMESPACE
    }
    labels = proxy_deployment(rendered["shared-proxy"])["spec"]["template"]["metadata"]["labels"]
    assert selects(proxy_peer["podSelector"]["matchLabels"], labels)
    proxy_ports = {
        p["containerPort"]
        for p in container(proxy_deployment(rendered["shared-proxy"]))["ports"]
        if p["name"] == "proxy"
    }
    assert proxy_rule["ports"] == [{"port": port, "protocol": "TCP"} for port in proxy_ports]
    [dns_peer] = dns_rule["to"]
    assert dns_peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kube-system"
    }
    assert dns_peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    assert sorted((p["port"], p["protocol"]) for p in dns_rule["ports"]) == [
        (53, "TCP"),
        (53, "UDP"),
    ]
    assert not any("ipBlock" in peer for rule in spec["egress"] for peer in rule["to"])


def test_the_agent_gets_the_sessions_proxy_variables_and_trusts_the_ca(rendered: Objects) -> None:
    objects = rendered["agents"]
    agent = find(objects, "Deployment", "agent")
    c = container(agent)
    sources = {k: v["name"] for source in c["envFrom"] for k, v in source.items()}
    session = secret_data(find(objects, "Secret", sources["secretRef"]))
    proxy_url = f"http://agent:{SESSION_TOKEN}@credproxy.{PROXY_NAMESPACE}.svc.cluster.local:8080"
    assert {k: v.decode() for k, v in session.items() if k in PROXY_VARS} == dict.fromkeys(
        PROXY_VARS, proxy_url
    )
    assert {k: v.decode() for k, v in session.items() if k in NO_PROXY_VARS} == dict.fromkeys(
        NO_PROXY_VARS, ""
    )
    assert not set(session) & set(CA_VARS), "the CA path of the proxy's pod is not the agent's"
    trust = find(objects, "ConfigMap", sources["configMapRef"])["data"]
    assert trust == dict.fromkeys(CA_VARS, AGENT_CA)
    [mount] = [m for m in c["volumeMounts"] if AGENT_CA.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    [volume] = [
        v for v in agent["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    ca = find(objects, "ConfigMap", "credproxy-ca")
    assert volume["configMap"]["name"] == ca["metadata"]["name"]
    assert set(ca["data"]) == {AGENT_CA.rsplit("/", 1)[1]}
    assert "BEGIN CERTIFICATE" in ca["data"]["credproxy-ca.pem"]


def test_the_documented_session_secret_per_workload_renders_and_is_used(
    tmp_path: Path, ca_dir: Path
) -> None:
    """docs/deployment.md's two snippets, applied to a copy of agents/: each workload gets
    its own Secret, renamed with its hash, and names only its own."""
    doc = DEPLOYMENT_DOC.read_text()
    section = doc[doc.index("**A session Secret per workload.**") :]
    generators, env_from = (
        yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, re.S)[:2]
    )
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUSTOMIZE, tree)
    install_files(tree, ca_dir)
    agents = tree / "agents"
    (agents / "secrets" / "reviewer.env").write_text(
        (agents / "secrets" / "session.env").read_text().replace("agent:", "reviewer:")
    )
    kustomization = yaml.safe_load((agents / "kustomization.yaml").read_text())
    kustomization["secretGenerator"] = generators["secretGenerator"]
    kustomization["resources"].append("reviewer.yaml")
    (agents / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    reviewer = yaml.safe_load((agents / "agent.yaml").read_text())
    reviewer["metadata"]["name"] = "reviewer"
    reviewer["spec"]["template"]["spec"]["containers"][0]["envFrom"] = env_from["envFrom"]
    (agents / "reviewer.yaml").write_text(yaml.safe_dump(reviewer))
    objects = kustomize(agents)
    secrets = {
        o["metadata"]["name"]: secret_data(o)["HTTPS_PROXY"]
        for o in objects
        if o["kind"] == "Secret"
    }
    used = {
        o["metadata"]["name"]: container(o)["envFrom"][0]["secretRef"]["name"]
        for o in objects
        if o["kind"] == "Deployment"
    }
    assert len(secrets) == 2 and set(used.values()) == set(secrets)
    assert used["agent"].startswith("credproxy-session-") and b"//agent:" in secrets[used["agent"]]
    assert used["reviewer"].startswith("credproxy-session-reviewer-")
    assert b"//reviewer:" in secrets[used["reviewer"]]
