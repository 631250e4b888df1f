//! The controller's node subnet allocation (OVN-Kubernetes' cluster manager's job): at each
//! round the leader allocates ([`crate::model::subnets::allocate`]) from the cluster networks'
//! `hostPrefix` and writes what changed on the Nodes, one annotation per merge patch. The
//! Nodes are the only record, so a new leader carries on from what they say.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use crate::{
    kubernetes::KubeSource,
    model::subnets::{SubnetPool, allocate},
    source::ClusterState,
};

/// How long a write is trusted to be on its way before it is made again: the watch brings
/// the Node back within this, and a failed or lost write is retried after it.
const WRITE_SETTLES: Duration = Duration::from_secs(10);

/// The leader's allocation state between rounds: what it wrote lately, what it reported.
#[derive(Debug, Default)]
pub struct SubnetAllocator {
    written: BTreeMap<(String, &'static str), (String, Instant)>,
    reported: BTreeSet<String>,
}

impl SubnetAllocator {
    /// Allocates what the nodes of `state` lack and writes it; returns how many annotations
    /// were written. Nothing without the cluster's networks (no `hostPrefix`, no pools).
    pub async fn round(&mut self, state: &ClusterState, source: &KubeSource) -> usize {
        let hybrid = state.hybrid.and_then(|h| {
            Some(SubnetPool {
                network: ipnet::IpNet::V4(h.network?),
                host_prefix: h.host_prefix?,
            })
        });
        if state.subnet_pools.is_empty() && hybrid.is_none() {
            return 0;
        }
        let nodes = state.nodes.to_vec();
        let allocation = allocate(&nodes, &state.subnet_pools, hybrid);
        for problem in &allocation.problems {
            if self.reported.insert(problem.clone()) {
                tracing::warn!(problem, "node subnet allocation");
            }
        }
        self.reported.retain(|p| allocation.problems.contains(p));
        let mut count = 0;
        for write in allocation.writes {
            let key = (write.node.clone(), write.key);
            if let Some((value, at)) = self.written.get(&key)
                && *value == write.value
                && at.elapsed() < WRITE_SETTLES
            {
                continue;
            }
            let annotations = BTreeMap::from([(write.key.to_owned(), write.value.clone())]);
            match source.annotate_node(&write.node, &annotations).await {
                Ok(()) => {
                    tracing::info!(
                        node = write.node,
                        key = write.key,
                        value = write.value,
                        "node subnet allocated"
                    );
                    count += 1;
                }
                Err(error) => tracing::warn!(%error, node = write.node, "writing a node subnet"),
            }
            self.written.insert(key, (write.value, Instant::now()));
        }
        self.written
            .retain(|_, (_, at)| at.elapsed() < WRITE_SETTLES);
        count
    }
}
