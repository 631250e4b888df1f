//! From an `EgressRouter` to the three objects that make the router (pure, no I/O): the
//! NetworkAttachmentDefinition that gives the router pod its macvlan through this project's
//! `egress-router` plugin, the Deployment of that one pod, and the Service in front of it.
//! The attachment's configuration is checked by the plugin's own parser ([`super::config`]),
//! so what the controller accepts is what the plugin will run; a refusal names the
//! EgressRouter's field.
//!
//! Decisions: the three objects are named after the EgressRouter (two routers in one
//! namespace do not collide; OpenShift's operator uses fixed names), all owned by it (the
//! garbage collector removes them with it). The Deployment has one replica and the `Recreate`
//! strategy: the reserved address is on one pod at a time, the old pod's macvlan gone before
//! the new one claims the address. The Service carries the redirect rules' ports; a router
//! with only a fallback gets a headless Service (no port list to give), whose name still
//! resolves to the router pod. The router pod keeps the label OpenShift's documentation
//! selects on (`app: egress-router-cni`).

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy},
        core::v1::{
            Capabilities, Container, PodSpec, PodTemplateSpec, ResourceRequirements,
            SecurityContext, Service, ServicePort, ServiceSpec,
        },
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use serde_json::{Value, json};

use super::config::{self, RouterConf};
use crate::api::egressrouter::{
    EgressRouter, EgressRouterMode, MacvlanMode, RedirectConfig, RedirectProtocol,
};

/// The label naming the EgressRouter an object was made for (the Service's selector).
pub const ROUTER_LABEL: &str = "egressrouter.network.operator.openshift.io/name";
/// The label OpenShift's documentation selects the router pod with.
pub const APP_LABEL: (&str, &str) = ("app", "egress-router-cni");
/// Multus' annotation: the pod's additional networks.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// The router pod's only container: it holds the pod's network namespace, the plugin did the
/// rest. A pause image is all it needs.
pub const DEFAULT_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// The attachment's configuration version (the plugin takes 0.4.0 to 1.1.0).
const CNI_VERSION: &str = "1.0.0";

/// The objects one EgressRouter asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterObjects {
    /// `k8s.cni.cncf.io/v1 NetworkAttachmentDefinition` (no type in k8s-openapi).
    pub attachment: Value,
    pub deployment: Deployment,
    pub service: Service,
    /// The attachment's configuration as the plugin reads it.
    pub conf: RouterConf,
}

/// The objects for `router`, the pod running `image`; the error names the field.
pub fn plan(router: &EgressRouter, image: &str) -> Result<RouterObjects, String> {
    let name = router
        .metadata
        .name
        .clone()
        .ok_or("metadata.name: missing")?;
    let namespace = router
        .metadata
        .namespace
        .clone()
        .ok_or("metadata.namespace: missing")?;
    let config = attachment_config(router, &name)?;
    let conf = config::parse(config.to_string().as_bytes())
        .map_err(|why| in_router_terms(&why, router.spec.redirect.as_ref()))?;
    let owner = owner_reference(router, &name);
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: Some(namespace),
        labels: Some(BTreeMap::from([(ROUTER_LABEL.to_owned(), name.clone())])),
        owner_references: owner.map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    let attachment = json!({
        "apiVersion": "k8s.cni.cncf.io/v1",
        "kind": "NetworkAttachmentDefinition",
        "metadata": meta,
        "spec": { "config": config.to_string() },
    });
    Ok(RouterObjects {
        attachment,
        deployment: deployment(meta.clone(), &name, image),
        service: service(meta, &name, &conf),
        conf,
    })
}

/// The plugin's configuration for `router`, as OpenShift's operator writes it: the rules as
/// `<port> <PROTOCOL> <address> [<remote port>]` lines, then the fallback address.
fn attachment_config(router: &EgressRouter, name: &str) -> Result<Value, String> {
    let spec = &router.spec;
    let EgressRouterMode::Redirect = spec.mode;
    let [address] = spec.addresses.as_slice() else {
        return Err(format!(
            "spec.addresses: {} given; a router holds one reserved address",
            spec.addresses.len()
        ));
    };
    let gateway = address.gateway.as_deref().ok_or_else(|| {
        "spec.addresses[0].gateway: missing (the router's next hop on the reserved address's network)"
            .to_owned()
    })?;
    let redirect = spec.redirect.clone().unwrap_or_default();
    if redirect.redirect_rules.is_empty() && redirect.fallback_ip.is_none() {
        return Err(
            "spec.redirect: neither redirectRules nor fallbackIP; the router would send nothing on"
                .to_owned(),
        );
    }
    let mut destinations = Vec::new();
    for (index, rule) in redirect.redirect_rules.iter().enumerate() {
        let field = format!("spec.redirect.redirectRules[{index}]");
        let port = |value: i32, what: &str| {
            u16::try_from(value)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{field}.{what}: {value} is not a port (1-65535)"))
        };
        let port_number = port(rule.port, "port")?;
        let target = port(rule.target_port.unwrap_or(rule.port), "targetPort")?;
        destinations.push(format!(
            "{port_number} {} {} {target}",
            protocol_name(rule.protocol),
            rule.destination_ip
        ));
    }
    destinations.extend(redirect.fallback_ip.clone());
    let macvlan = &spec.network_interface.macvlan;
    let mut interface_args = json!({ "mode": macvlan_mode_name(macvlan.mode) });
    if let Some(master) = &macvlan.master {
        interface_args["master"] = json!(master);
    }
    Ok(json!({
        "cniVersion": CNI_VERSION,
        "name": name,
        "type": "egress-router",
        "interfaceType": "macvlan",
        "interfaceArgs": interface_args,
        "ip": {
            "addresses": [address.ip],
            "destinations": destinations,
            "gateway": gateway,
        },
    }))
}

/// The plugin's refusal with its fields named as the EgressRouter's.
fn in_router_terms(why: &str, redirect: Option<&RedirectConfig>) -> String {
    let rules = redirect.map_or(0, |r| r.redirect_rules.len());
    let mut message = why.to_owned();
    // The fallback line follows the rules (attachment_config). The closing bracket is part of
    // the pattern, so `[1]` never matches inside `[10]`.
    for index in 0..=rules {
        let field = if index == rules {
            "spec.redirect.fallbackIP".to_owned()
        } else {
            format!("spec.redirect.redirectRules[{index}]")
        };
        message = message.replace(&format!("ip.destinations[{index}]"), &field);
    }
    message
        .replace("ip.addresses[0]", "spec.addresses[0].ip")
        .replace("ip.gateway", "spec.addresses[0].gateway")
        .replace(
            "interfaceArgs.master",
            "spec.networkInterface.macvlan.master",
        )
}

fn protocol_name(protocol: RedirectProtocol) -> &'static str {
    match protocol {
        RedirectProtocol::Tcp => "TCP",
        RedirectProtocol::Udp => "UDP",
        RedirectProtocol::Sctp => "SCTP",
    }
}

fn macvlan_mode_name(mode: MacvlanMode) -> &'static str {
    match mode {
        MacvlanMode::Bridge => "bridge",
        MacvlanMode::Private => "private",
        MacvlanMode::Vepa => "vepa",
        MacvlanMode::Passthru => "passthru",
    }
}

/// The EgressRouter as the controlling owner of what is made for it (none without a UID: an
/// object read from a manifest directory).
fn owner_reference(router: &EgressRouter, name: &str) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "network.operator.openshift.io/v1".into(),
        kind: "EgressRouter".into(),
        name: name.to_owned(),
        uid: router.metadata.uid.clone()?,
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

/// One router pod, replaced only after the old one is gone.
fn deployment(meta: ObjectMeta, name: &str, image: &str) -> Deployment {
    let selector = BTreeMap::from([(ROUTER_LABEL.to_owned(), name.to_owned())]);
    let mut pod_labels = selector.clone();
    pod_labels.insert(APP_LABEL.0.into(), APP_LABEL.1.into());
    let container = Container {
        name: "egress-router".into(),
        image: Some(image.to_owned()),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), Quantity("10m".into())),
                ("memory".to_owned(), Quantity("16Mi".into())),
            ])),
            ..ResourceRequirements::default()
        }),
        // The plugin configures the pod from the node; the container needs nothing.
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            run_as_user: Some(65535),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    Deployment {
        metadata: meta,
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                ..DeploymentStrategy::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(BTreeMap::from([(
                        NETWORKS_ANNOTATION.to_owned(),
                        name.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    automount_service_account_token: Some(false),
                    termination_grace_period_seconds: Some(5),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

/// The router's Service: its rules' ports, of the reserved address's family (the router's
/// nftables table is of that family only); headless when it has only a fallback.
fn service(meta: ObjectMeta, name: &str, conf: &RouterConf) -> Service {
    let family = match conf.address {
        IpNet::V4(_) => "IPv4",
        IpNet::V6(_) => "IPv6",
    };
    let ports: Vec<ServicePort> = conf
        .rules
        .iter()
        .map(|rule| ServicePort {
            name: Some(format!("{}-{}", rule.protocol.name(), rule.port)),
            port: i32::from(rule.port),
            protocol: Some(rule.protocol.name().to_ascii_uppercase()),
            target_port: Some(IntOrString::Int(i32::from(rule.port))),
            ..ServicePort::default()
        })
        .collect();
    let headless = ports.is_empty();
    Service {
        metadata: meta,
        spec: Some(ServiceSpec {
            selector: Some(BTreeMap::from([(ROUTER_LABEL.to_owned(), name.to_owned())])),
            ports: (!headless).then_some(ports),
            cluster_ip: headless.then(|| "None".to_owned()),
            ip_families: Some(vec![family.to_owned()]),
            ip_family_policy: Some("SingleStack".into()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The reserved address an EgressRouter asks for, if it names one that parses.
pub fn reserved_address(router: &EgressRouter) -> Option<IpAddr> {
    // An invalid router reserves nothing: its pod is never made (its status says why), so
    // its address must stay free for a valid router (and claimable by no one else's pod).
    plan(router, "")
        .ok()
        .map(|objects| objects.conf.address.addr())
}

/// Which EgressRouter holds each reserved address (namespace, name): where two ask for one
/// address, the oldest (then the first by namespace and name); the others get none, as one
/// address can be on one router pod only.
pub fn address_holders<'a>(
    routers: impl IntoIterator<Item = &'a Arc<EgressRouter>>,
) -> BTreeMap<IpAddr, (String, String)> {
    let mut claims: Vec<(_, IpAddr, (String, String))> = routers
        .into_iter()
        .filter_map(|router| {
            let key = (
                router.metadata.namespace.clone()?,
                router.metadata.name.clone()?,
            );
            // Objects without a creation time (read from files) count as the newest.
            let created = router.metadata.creation_timestamp.as_ref().map(|t| t.0);
            Some(((created.is_none(), created), reserved_address(router)?, key))
        })
        .collect();
    claims.sort();
    let mut holders = BTreeMap::new();
    for (_, address, key) in claims {
        holders.entry(address).or_insert(key);
    }
    holders
}

/// Why `router` may not hold its address: another router holds it (`holders` from
/// [`address_holders`]). The message names the field and the holder.
pub fn conflict(
    router: &EgressRouter,
    holders: &BTreeMap<IpAddr, (String, String)>,
) -> Option<String> {
    let address = reserved_address(router)?;
    let (namespace, name) = holders.get(&address)?;
    let me = (
        router.metadata.namespace.as_ref()?,
        router.metadata.name.as_ref()?,
    );
    (me != (namespace, name)).then(|| {
        format!(
            "spec.addresses[0].ip: {address} is held by the older EgressRouter {namespace}/{name}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egressrouter::config::{Protocol, Redirect};

    fn router(yaml: &str) -> EgressRouter {
        serde_yaml::from_str(yaml).expect("EgressRouter")
    }

    /// The seed's example (OpenShift's documentation), with a UID as the API server gives.
    const EXAMPLE: &str = "
apiVersion: network.operator.openshift.io/v1
kind: EgressRouter
metadata: {name: egress-router-redirect, namespace: egress, uid: 5c7a9d36-0000-4000-8000-000000000001}
spec:
  networkInterface: {macvlan: {mode: Bridge}}
  addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}]
  mode: Redirect
  redirect:
    redirectRules:
    - {destinationIP: 10.0.0.99, port: 80, protocol: UDP}
    - {destinationIP: 203.0.113.26, port: 8080, targetPort: 80, protocol: TCP}
    - {destinationIP: 203.0.113.27, port: 8443, targetPort: 443, protocol: TCP}
    fallbackIP: 203.0.113.28
";

    #[test]
    fn the_documented_router_makes_an_attachment_the_plugin_runs_as_written() {
        let objects = plan(&router(EXAMPLE), DEFAULT_IMAGE).expect("valid");
        let ip = |t: &str| t.parse::<IpAddr>().unwrap();
        assert_eq!(objects.conf.address, "192.168.12.99/24".parse().unwrap());
        assert_eq!(objects.conf.gateway, ip("192.168.12.1"));
        assert_eq!(objects.conf.master, None);
        assert_eq!(objects.conf.mode, config::MacvlanMode::Bridge);
        assert_eq!(
            objects.conf.rules,
            vec![
                Redirect {
                    port: 80,
                    protocol: Protocol::Udp,
                    destination: ip("10.0.0.99"),
                    target_port: 80
                },
                Redirect {
                    port: 8080,
                    protocol: Protocol::Tcp,
                    destination: ip("203.0.113.26"),
                    target_port: 80
                },
                Redirect {
                    port: 8443,
                    protocol: Protocol::Tcp,
                    destination: ip("203.0.113.27"),
                    target_port: 443
                },
            ]
        );
        assert_eq!(objects.conf.fallback, Some(ip("203.0.113.28")));
        // The attachment: named after the router, owned by it, its config the plugin's.
        let nad = &objects.attachment;
        assert_eq!(nad["apiVersion"], "k8s.cni.cncf.io/v1");
        assert_eq!(nad["kind"], "NetworkAttachmentDefinition");
        assert_eq!(nad["metadata"]["name"], "egress-router-redirect");
        assert_eq!(nad["metadata"]["namespace"], "egress");
        assert_eq!(
            nad["metadata"]["ownerReferences"],
            json!([{
                "apiVersion": "network.operator.openshift.io/v1",
                "kind": "EgressRouter",
                "name": "egress-router-redirect",
                "uid": "5c7a9d36-0000-4000-8000-000000000001",
                "controller": true,
                "blockOwnerDeletion": true,
            }])
        );
        let config: Value =
            serde_json::from_str(nad["spec"]["config"].as_str().expect("a string")).unwrap();
        assert_eq!(
            config["ip"]["destinations"],
            json!([
                "80 UDP 10.0.0.99 80",
                "8080 TCP 203.0.113.26 80",
                "8443 TCP 203.0.113.27 443",
                "203.0.113.28"
            ])
        );
        assert_eq!(config["type"], "egress-router");
        assert_eq!(config["interfaceArgs"], json!({"mode": "bridge"}));
    }

    #[test]
    fn the_deployment_runs_one_router_pod_at_a_time_on_its_attachment() {
        let objects = plan(&router(EXAMPLE), "example.org/pause:1").expect("valid");
        let value = serde_json::to_value(&objects.deployment).unwrap();
        assert_eq!(value["metadata"]["name"], "egress-router-redirect");
        assert_eq!(value["spec"]["replicas"], 1);
        assert_eq!(value["spec"]["strategy"], json!({"type": "Recreate"}));
        assert_eq!(
            value["spec"]["selector"],
            json!({"matchLabels": {ROUTER_LABEL: "egress-router-redirect"}})
        );
        let template = &value["spec"]["template"];
        assert_eq!(
            template["metadata"]["labels"],
            json!({ROUTER_LABEL: "egress-router-redirect", "app": "egress-router-cni"})
        );
        assert_eq!(
            template["metadata"]["annotations"],
            json!({NETWORKS_ANNOTATION: "egress-router-redirect"})
        );
        let container = &template["spec"]["containers"][0];
        assert_eq!(container["image"], "example.org/pause:1");
        assert_eq!(
            container["securityContext"]["capabilities"],
            json!({"drop": ["ALL"]})
        );
        assert_eq!(container["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            value["metadata"]["ownerReferences"][0]["kind"],
            "EgressRouter"
        );
    }

    #[test]
    fn the_service_carries_the_rules_ports_in_the_reserved_family() {
        let objects = plan(&router(EXAMPLE), DEFAULT_IMAGE).expect("valid");
        let value = serde_json::to_value(&objects.service).unwrap();
        assert_eq!(
            value["spec"],
            json!({
                "selector": {ROUTER_LABEL: "egress-router-redirect"},
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "ports": [
                    {"name": "udp-80", "port": 80, "protocol": "UDP", "targetPort": 80},
                    {"name": "tcp-8080", "port": 8080, "protocol": "TCP", "targetPort": 8080},
                    {"name": "tcp-8443", "port": 8443, "protocol": "TCP", "targetPort": 8443},
                ],
            })
        );
        // Only a fallback: no ports to list, a headless Service of the IPv6 family.
        let fallback_only = router(
            "
metadata: {name: r, namespace: n}
spec:
  addresses: [{ip: '2001:db8:12::99/64', gateway: '2001:db8:12::1'}]
  redirect: {fallbackIP: '2001:db8:ff::1'}
",
        );
        let objects = plan(&fallback_only, DEFAULT_IMAGE).expect("valid");
        let value = serde_json::to_value(&objects.service).unwrap();
        assert_eq!(
            value["spec"],
            json!({
                "selector": {ROUTER_LABEL: "r"},
                "clusterIP": "None",
                "ipFamilies": ["IPv6"],
                "ipFamilyPolicy": "SingleStack",
            })
        );
        // Read from a manifest directory (no UID): nothing to own it by.
        assert_eq!(value["metadata"].get("ownerReferences"), None);
    }

    #[test]
    fn refusals_name_the_routers_field() {
        let refused = |spec: &str| {
            plan(
                &router(&format!(
                    "metadata: {{name: r, namespace: n}}\nspec: {spec}"
                )),
                DEFAULT_IMAGE,
            )
            .expect_err("refused")
        };
        let rules = "redirect: {redirectRules: [{destinationIP: 203.0.113.26, port: 80, protocol: TCP}, {destinationIP: 203.0.113.27, port: 80, protocol: TCP}]}";
        assert_eq!(
            refused(&format!(
                "{{addresses: [{{ip: 192.168.12.99/24, gateway: 192.168.12.1}}], {rules}}}"
            )),
            "spec.redirect.redirectRules[1]: tcp port 80 is redirected already by spec.redirect.redirectRules[0]"
        );
        assert_eq!(
            refused("{addresses: [], redirect: {fallbackIP: 203.0.113.1}}"),
            "spec.addresses: 0 given; a router holds one reserved address"
        );
        assert_eq!(
            refused("{addresses: [{ip: 192.168.12.99/24}], redirect: {fallbackIP: 203.0.113.1}}"),
            "spec.addresses[0].gateway: missing (the router's next hop on the reserved address's network)"
        );
        assert_eq!(
            refused(
                "{addresses: [{ip: 192.168.12.99, gateway: 192.168.12.1}], redirect: {fallbackIP: 203.0.113.1}}"
            ),
            "spec.addresses[0].ip: \"192.168.12.99\" is not an address with its prefix (e.g. 192.168.12.99/24)"
        );
        assert_eq!(
            refused(
                "{addresses: [{ip: 192.168.12.99/24, gateway: 10.0.0.1}], redirect: {fallbackIP: 203.0.113.1}}"
            ),
            "spec.addresses[0].gateway: 10.0.0.1 is not another address of 192.168.12.0/24, the reserved address's network"
        );
        assert_eq!(
            refused(
                "{addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}], redirect: {fallbackIP: '2001:db8::1'}}"
            ),
            "spec.redirect.fallbackIP: 2001:db8::1 is not of the reserved address 192.168.12.99's family"
        );
        assert_eq!(
            refused("{addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}]}"),
            "spec.redirect: neither redirectRules nor fallbackIP; the router would send nothing on"
        );
        assert_eq!(
            refused(
                "{addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}], redirect: {redirectRules: [{destinationIP: 203.0.113.26, port: 70000, protocol: UDP}]}}"
            ),
            "spec.redirect.redirectRules[0].port: 70000 is not a port (1-65535)"
        );
        assert_eq!(
            refused(
                "{addresses: [{ip: 192.168.12.99/24, gateway: 192.168.12.1}], networkInterface: {macvlan: {mode: Bridge, master: 'eth0/../x'}}, redirect: {fallbackIP: 203.0.113.1}}"
            )
            .split(':')
            .next(),
            Some("spec.networkInterface.macvlan.master")
        );
    }

    #[test]
    fn an_address_asked_for_twice_is_held_by_the_oldest_router() {
        let router = |namespace: &str, name: &str, created: Option<&str>| {
            let created = created.map_or(String::new(), |t| format!(", creationTimestamp: '{t}'"));
            Arc::new(self::router(&format!(
                "metadata: {{name: {name}, namespace: {namespace}{created}}}\n\
                 spec: {{addresses: [{{ip: 192.168.12.99/24, gateway: 192.168.12.1}}], \
                 redirect: {{fallbackIP: 203.0.113.1}}}}"
            )))
        };
        // An older router whose spec is invalid (no gateway) holds nothing.
        let invalid = Arc::new(self::router(
            "metadata: {name: broken, namespace: d, creationTimestamp: '2026-11-01T00:00:00Z'}\n\
             spec: {addresses: [{ip: 192.168.12.99/24}], redirect: {fallbackIP: 203.0.113.1}}",
        ));
        assert_eq!(reserved_address(&invalid), None);
        let routers = [
            router("b", "new", Some("2026-12-02T00:00:00Z")),
            router("c", "file", None),
            router("a", "old", Some("2026-12-01T00:00:00Z")),
            invalid,
        ];
        let holders = address_holders(&routers);
        assert_eq!(
            holders.get(&"192.168.12.99".parse().unwrap()),
            Some(&("a".to_owned(), "old".to_owned()))
        );
        assert_eq!(conflict(&routers[2], &holders), None);
        assert_eq!(
            conflict(&routers[0], &holders).as_deref(),
            Some("spec.addresses[0].ip: 192.168.12.99 is held by the older EgressRouter a/old")
        );
        assert!(conflict(&routers[1], &holders).is_some());
    }

    #[test]
    fn the_schema_refuses_what_the_upstream_type_refuses() {
        // Decoding stands for the API server's schema: an unknown mode or protocol, or a
        // macvlan mode outside the four, never reaches the controller.
        for spec in [
            "{mode: Reverse, addresses: [{ip: 192.168.12.99/24}]}",
            "{addresses: [{ip: 192.168.12.99/24}], redirect: {redirectRules: [{destinationIP: 203.0.113.1, port: 1, protocol: ICMP}]}}",
            "{addresses: [{ip: 192.168.12.99/24}], networkInterface: {macvlan: {mode: Source}}}",
        ] {
            let yaml = format!("metadata: {{name: r, namespace: n}}\nspec: {spec}");
            assert!(
                serde_yaml::from_str::<EgressRouter>(&yaml).is_err(),
                "{spec} decoded"
            );
        }
        // And the CRD states the limits for the API server.
        use kube::CustomResourceExt as _;
        let crd = serde_json::to_value(EgressRouter::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let rule = &spec["properties"]["redirect"]["properties"]["redirectRules"]["items"];
        assert_eq!(rule["properties"]["port"]["minimum"], 1.0);
        assert_eq!(rule["properties"]["port"]["maximum"], 65535.0);
        assert_eq!(
            rule["properties"]["protocol"]["enum"],
            json!(["TCP", "UDP", "SCTP"])
        );
        assert_eq!(spec["properties"]["mode"]["enum"], json!(["Redirect"]));
        assert_eq!(spec["properties"]["addresses"]["minItems"], 1);
        assert_eq!(
            spec["properties"]["networkInterface"]["properties"]["macvlan"]["properties"]["mode"]["enum"],
            json!(["Bridge", "Private", "VEPA", "Passthru"])
        );
    }
}
