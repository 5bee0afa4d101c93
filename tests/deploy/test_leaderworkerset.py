"""Multi-node serving groups (deploy/components/leaderworkerset): each role rendered with the component is
a LeaderWorkerSet whose leader and workers are the role's pod as the Deployment had it (one template, a
broker sidecar in every pod), the group's shape given to the server from what LWS sets, the ranks of a
group admitted to each other, and nothing of the Deployment left. LWS is a custom resource the
Kubernetes schemas lack: its fields are checked here, and its pod templates validated as Pods."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.support.deploy import OVERLAYS, REPO_ROOT, broker, kustomize, literal_env, one, render_overlay, selects

GROUP_ENV = {"NNODES": "$(LWS_GROUP_SIZE)", "NODE_RANK": "$(LWS_WORKER_INDEX)",
             "DIST_INIT_ADDR": "$(LWS_LEADER_ADDRESS):20000"}


def as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]}


@pytest.fixture(params=OVERLAYS)
def rendered_pair(request, tmp_path):
    role = request.param
    return role, kustomize(REPO_ROOT / "deploy" / "overlays" / role), render_overlay(tmp_path, role, "leaderworkerset")


def test_the_role_becomes_one_leaderworkerset_of_groups_restarted_whole(rendered_pair):
    role, _, docs = rendered_pair
    assert not [d for d in docs if d["kind"] == "Deployment"]
    lws = one(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == f"{role}-inference"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] >= 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["replicas"] >= 1 and lws["spec"]["startupPolicy"] in ("LeaderCreated", "LeaderReady")


@pytest.mark.parametrize("which", ["leaderTemplate", "workerTemplate"])
def test_every_pod_of_a_group_is_the_roles_pod_with_its_own_broker_and_its_place_in_the_group(rendered_pair,
                                                                                                which):
    _, plain, docs = rendered_pair
    template = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"][which]
    kubernetes_validate.validate(as_pod(template), kubernetes_validate.latest_version(), strict=True)
    expected = one(plain, "Deployment")["spec"]["template"]
    server = template["spec"]["containers"][0]
    assert server["name"] == "inference-server"
    assert literal_env(server) == {**literal_env(expected["spec"]["containers"][0]), **GROUP_ENV}
    # Everything else is the Deployment's pod, the broker sidecar included: one template, no drift.
    rest = {**template["spec"], "containers": [{**server, "env": expected["spec"]["containers"][0]["env"]}]}
    assert rest == expected["spec"] and template["metadata"] == expected["metadata"]
    assert broker([{"kind": "Deployment", "spec": {"template": template}}])["restartPolicy"] == "Always"


def test_the_roles_service_budget_and_policies_select_the_groups_pods(rendered_pair):
    _, _, docs = rendered_pair
    labels = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert selects({"matchLabels": one(docs, "Service")["spec"]["selector"]}, labels)
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"], labels)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert all(selects(p["spec"]["podSelector"], labels) for p in policies) and len(policies) == 2


def test_the_ranks_of_a_group_may_reach_each_other(rendered_pair):
    role, _, docs = rendered_pair
    (group,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == f"{role}-inference-group"]
    labels = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    assert group["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = group["spec"]["ingress"]
    assert "ports" not in rule  # every port: the rendezvous and the collectives' own
    assert [selects(peer["podSelector"], labels) for peer in rule["from"]] == [True]
    other = {**labels, "app.kubernetes.io/component": "decode" if role == "prefill" else "prefill"}
    assert not selects(rule["from"][0]["podSelector"], other)  # the other role's pods are not let in here
