//! The cluster the planner plans for, as a TOML file.
//!
//! ```toml
//! name = "8x H100 SXM (NVLink 4)"
//! nodes = 1
//! devices_per_node = 8
//! # true for local ranks of one CPU: the devices of a node share its compute and memory, so
//! # the rates and the memory below are the node's, split among the ranks that run on it.
//! shared_node = false
//! overlap = true               # ring transfers overlap the block compute
//! nics_per_node = 8            # NICs the devices share between nodes; absent: one per device
//!
//! [device]
//! matmul_flops = 6.0e14        # dense products in the training dtype, FLOP/s
//! attention_flops = 4.0e14     # flash attention forward+backward, model FLOP/s
//! memory_bandwidth = 3.0e12    # bytes/s (element-wise work, the optimizer)
//! memory_bytes = 80.0e9        # usable memory
//!
//! [intra_node]                 # per device, one direction
//! bandwidth = 3.0e11           # bytes/s
//! latency = 5.0e-6             # seconds per message
//!
//! [inter_node]                 # per NIC, one direction
//! bandwidth = 4.5e10
//! latency = 1.0e-5
//! ```
//!
//! Presets ([`Hardware::preset`]) describe an 8-GPU NVLink node, a cluster of 8 of them over
//! InfiniBand, the clusters of the LoongTrain and USP papers (`a100-hdr-cluster`,
//! `a800-roce-cluster`, `l20-pcie-node`), and the 2-core development machine as
//! `cpl bench --calibrate` measured it.
//! `cpl bench --calibrate` writes the file for the machine it runs on.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Per-device compute and memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Dense matrix products in the training dtype, FLOP/s.
    pub matmul_flops: f64,
    /// Flash attention forward+backward, model FLOP/s (`3 x 4 S^2 h d x density` per call).
    pub attention_flops: f64,
    /// Bytes/s of element-wise work (norms, activations, residuals, the optimizer).
    pub memory_bandwidth: f64,
    /// Usable memory, bytes.
    pub memory_bytes: f64,
    /// Parameters per second of the optimizer step (gradient clipping and AdamW with f32
    /// masters) on one device; when absent, the step's 40 bytes per parameter at
    /// `memory_bandwidth`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_params_per_sec: Option<f64>,
}

/// One kind of link: bandwidth per device (per NIC for the inter-node link) and direction, and
/// latency per message.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Bytes/s per device and direction (NCCL-tests' bus bandwidth).
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

/// A cluster of `nodes` nodes of `devices_per_node` devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    pub nodes: usize,
    pub devices_per_node: usize,
    /// The devices of a node are ranks sharing one machine (local ranks of a CPU): `device`'s
    /// rates and memory are the node's, divided among the ranks placed on it.
    #[serde(default)]
    pub shared_node: bool,
    pub device: DeviceSpec,
    pub intra_node: LinkSpec,
    /// Between nodes: `bandwidth` is one NIC's (one per device when `nics_per_node` is absent).
    pub inter_node: LinkSpec,
    /// Ring transfers run while the previous block computes (GPUs with a copy engine); without,
    /// every transfer is exposed (local CPU ranks, whose cores do the copies).
    #[serde(default = "yes")]
    pub overlap: bool,
    /// Network adapters per node that the node's devices share for inter-node traffic (the
    /// cluster's description; LoongTrain's testbed has 4 for 8 GPUs). Absent: one per device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics_per_node: Option<usize>,
}

fn yes() -> bool {
    true
}

/// The built-in hardware descriptions: `(name, TOML)`.
const PRESETS: [(&str, &str); 6] = [
    ("h100-node", include_str!("presets/h100-node.toml")),
    ("h100-cluster", include_str!("presets/h100-cluster.toml")),
    ("cpu-2core", include_str!("presets/cpu-2core.toml")),
    (
        "a100-hdr-cluster",
        include_str!("presets/a100-hdr-cluster.toml"),
    ),
    (
        "a800-roce-cluster",
        include_str!("presets/a800-roce-cluster.toml"),
    ),
    ("l20-pcie-node", include_str!("presets/l20-pcie-node.toml")),
];

impl Hardware {
    /// Devices in all.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// The names of the presets.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|(n, _)| *n).collect()
    }

    /// A built-in description by name (see [`Hardware::preset_names`]).
    pub fn preset(name: &str) -> Result<Self> {
        let (_, text) = PRESETS.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            Error::Layout(format!(
                "no hardware preset {name:?}; presets: {}",
                Self::preset_names().join(", ")
            ))
        })?;
        Self::from_toml(text, &format!("preset {name}"))
    }

    /// A preset name, or a TOML file.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if PRESETS.iter().any(|(n, _)| *n == name_or_path) {
            return Self::preset(name_or_path);
        }
        let path = Path::new(name_or_path);
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Layout(format!(
                "hardware file {}: {e} (presets: {})",
                path.display(),
                Self::preset_names().join(", ")
            ))
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses and validates a description; errors name `source` and the field.
    pub fn from_toml(text: &str, source: &str) -> Result<Self> {
        let hw: Hardware = toml::from_str(text)
            .map_err(|e| Error::Layout(format!("hardware description {source}: {e}")))?;
        hw.validate()
            .map_err(|e| Error::Layout(format!("hardware description {source}: {e}")))?;
        Ok(hw)
    }

    /// The description as TOML.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self)
            .map_err(|e| Error::Layout(format!("hardware description {}: {e}", self.name)))
    }

    /// Errors naming the field that is not positive (or not finite).
    pub fn validate(&self) -> Result<()> {
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err(Error::Layout(
                "nodes and devices_per_node must be at least 1".into(),
            ));
        }
        if self.nics_per_node == Some(0) {
            return Err(Error::Layout(
                "nics_per_node must be at least 1 (leave it out for one per device)".into(),
            ));
        }
        let d = &self.device;
        for (field, v) in [
            ("device.matmul_flops", d.matmul_flops),
            ("device.attention_flops", d.attention_flops),
            ("device.memory_bandwidth", d.memory_bandwidth),
            ("device.memory_bytes", d.memory_bytes),
            ("intra_node.bandwidth", self.intra_node.bandwidth),
            ("inter_node.bandwidth", self.inter_node.bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Layout(format!(
                    "{field} must be a positive number, got {v}"
                )));
            }
        }
        if let Some(v) = d.optimizer_params_per_sec {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Layout(format!(
                    "device.optimizer_params_per_sec must be a positive number, got {v}"
                )));
            }
        }
        for (field, v) in [
            ("intra_node.latency", self.intra_node.latency),
            ("inter_node.latency", self.inter_node.latency),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::Layout(format!(
                    "{field} must be a number of seconds, at least 0, got {v}"
                )));
            }
        }
        Ok(())
    }

    /// A rank's share of the device's rates and memory when `ranks_per_node` ranks run on a
    /// node: all of it on separate devices, `1 / ranks_per_node` on a shared node.
    pub fn share(&self, ranks_per_node: usize) -> f64 {
        if self.shared_node {
            1.0 / ranks_per_node.max(1) as f64
        } else {
            1.0
        }
    }

    /// Network adapters per node (one per device unless the description says otherwise).
    pub fn nics(&self) -> usize {
        self.nics_per_node.unwrap_or(self.devices_per_node).max(1)
    }

    /// Bytes/s each of `flows` concurrent inter-node transfers leaving one node gets: a flow
    /// uses at most one NIC, and the flows share the node's NICs.
    pub fn inter_node_flow_bandwidth(&self, flows: usize) -> f64 {
        let nics = self.nics() as f64;
        self.inter_node.bandwidth * (nics / flows.max(1) as f64).min(1.0)
    }

    /// The link a group of `size` ranks spaced `stride` apart in rank order uses (the groups
    /// of a mesh dimension tile the ranks, and all of them communicate at once): the intra-node
    /// link when every such group lies in one node; otherwise the inter-node link, every device
    /// of a node sending across at once and sharing the node's NICs.
    pub fn link(&self, stride: usize, size: usize) -> LinkSpec {
        let span = stride * size;
        if size <= 1 || span <= self.devices_per_node && self.devices_per_node.is_multiple_of(span)
        {
            self.intra_node
        } else {
            LinkSpec {
                bandwidth: self.inter_node_flow_bandwidth(self.devices_per_node),
                latency: self.inter_node.latency,
            }
        }
    }

    /// The link one step of a ring takes, where every rank of every ring (`size` ranks
    /// `stride` apart, the rings tiling `world` ranks) sends to its successor at once: the step
    /// waits for its slowest hop. Hops inside a node use the intra-node link; the hops that leave
    /// a node share its NICs ([`Hardware::inter_node_flow_bandwidth`]), so a ring whose only
    /// crossing hop is one per node gets a whole NIC where an all-to-all gets a device's share.
    pub fn ring_link(&self, stride: usize, size: usize, world: usize) -> LinkSpec {
        self.ring_jump_link(stride, size, world, 1)
    }

    /// [`Hardware::ring_link`] for an exchange in which every rank sends `hops` ranks ahead
    /// along its ring at once (a sliding window's ring skips steps: its blocks jump,
    /// `attention::ring`): more of a node's ranks may send across at once than in a step to
    /// the neighbour, sharing its NICs.
    pub fn ring_jump_link(
        &self,
        stride: usize,
        size: usize,
        world: usize,
        hops: usize,
    ) -> LinkSpec {
        let dpn = self.devices_per_node;
        let hops = hops % size.max(1);
        let crossing = (0..dpn.min(world))
            .filter(|&x| {
                let c = (x / stride) % size;
                let next = x - c * stride + ((c + hops) % size) * stride;
                next / dpn != x / dpn
            })
            .count();
        if size <= 1 || hops == 0 || crossing == 0 {
            self.intra_node
        } else {
            LinkSpec {
                bandwidth: self.inter_node_flow_bandwidth(crossing),
                latency: self.inter_node.latency,
            }
        }
    }

    /// Seconds of an all-to-all in which each of `size` ranks spaced `stride` apart sends
    /// `bytes` (to its `size - 1` peers alike) in `messages` messages: the share for peers on
    /// the same node moves at the intra-node rate while the rest crosses nodes at the same time,
    /// every device of the node sharing its NICs.
    pub fn all_to_all_time(&self, stride: usize, size: usize, bytes: f64, messages: f64) -> f64 {
        if size <= 1 {
            return 0.0;
        }
        let local = if stride >= self.devices_per_node {
            1
        } else {
            (self.devices_per_node / stride).clamp(1, size)
        };
        let remote = (size - local) as f64 / (size - 1) as f64;
        let link = self.link(stride, size);
        (bytes * (1.0 - remote) / self.intra_node.bandwidth)
            .max(bytes * remote / self.inter_node_flow_bandwidth(self.devices_per_node))
            + messages * link.latency
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_round_trip() {
        for name in Hardware::preset_names() {
            let hw = Hardware::preset(name).unwrap();
            let again = Hardware::from_toml(&hw.to_toml().unwrap(), "round trip").unwrap();
            assert_eq!(hw, again, "{name}");
        }
        assert!(Hardware::preset("tpu").is_err());
    }

    #[test]
    fn bad_descriptions_name_the_field() {
        let hw = Hardware::preset("h100-node").unwrap();
        let text = hw
            .to_toml()
            .unwrap()
            .replace("memory_bytes = ", "memory_bytes = -");
        let e = Hardware::from_toml(&text, "bad.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.toml") && e.contains("device.memory_bytes"),
            "{e}"
        );
        let e = Hardware::from_toml("name = 1", "x.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.toml"), "{e}");
        let e = Hardware::load("/nonexistent/hw.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/hw.toml"), "{e}");
    }

    #[test]
    fn groups_that_span_nodes_use_the_inter_node_link() {
        let hw = Hardware::preset("h100-cluster").unwrap();
        assert_eq!(hw.devices_per_node, 8);
        assert_eq!(hw.link(1, 8), hw.intra_node);
        assert_eq!(hw.link(2, 4), hw.intra_node);
        assert_eq!(hw.link(1, 16), hw.inter_node);
        assert_eq!(hw.link(8, 2), hw.inter_node);
        assert_eq!(hw.link(64, 1), hw.intra_node);
        // An all-to-all over 16 neighbours: 8 of 15 peers on other nodes; over 16 ranks 4
        // apart, 14 of 15.
        let x = 1e9;
        let near = hw.all_to_all_time(1, 16, x, 0.0);
        let far = hw.all_to_all_time(4, 16, x, 0.0);
        assert_eq!(near, x * 8.0 / 15.0 / hw.inter_node.bandwidth);
        assert_eq!(far, x * 14.0 / 15.0 / hw.inter_node.bandwidth);
        assert_eq!(
            hw.all_to_all_time(1, 8, x, 0.0),
            x / hw.intra_node.bandwidth
        );
    }

    /// Jumps along a ring (a window's skipped steps): on 8-GPU nodes with one NIC, a flat ring
    /// of 32 sends 1 hop per node across for a step to the neighbour, but `h` hops for a jump of
    /// `h` (up to the 8 ranks of a node), backwards alike (a jump of 30 is 2 back); a jump of the
    /// ring's size or 0 stays home; one of 1 is the neighbour ring's link.
    #[test]
    fn ring_jumps_send_more_hops_across() {
        let hw = Hardware {
            nics_per_node: Some(1),
            ..Hardware::preset("a100-hdr-cluster").unwrap()
        };
        let nic = hw.inter_node.bandwidth;
        assert_eq!(hw.ring_jump_link(1, 32, 32, 1), hw.ring_link(1, 32, 32));
        assert_eq!(hw.ring_jump_link(1, 32, 32, 1).bandwidth, nic);
        for (hops, flows) in [(2, 2.0), (3, 3.0), (30, 2.0), (8, 8.0), (12, 8.0)] {
            let l = hw.ring_jump_link(1, 32, 32, hops);
            let want = nic / flows;
            assert!(
                (l.bandwidth - want).abs() <= 1e-12 * want,
                "a jump of {hops}: {} vs {want}",
                l.bandwidth
            );
            assert_eq!(l.latency, hw.inter_node.latency);
        }
        assert_eq!(hw.ring_jump_link(1, 32, 32, 32), hw.intra_node);
        assert_eq!(hw.ring_jump_link(1, 32, 32, 0), hw.intra_node);
        // A ring inside a node stays on NVLink whatever the jump.
        assert_eq!(hw.ring_jump_link(1, 8, 32, 5), hw.intra_node);
    }

    /// LoongTrain's testbed: 4 NICs for 8 GPUs. A ring step waits for its slowest hop, and the
    /// hops leaving a node share its NICs.
    #[test]
    fn ring_hops_share_the_nics_of_a_node() {
        let hw = Hardware::preset("a100-hdr-cluster").unwrap();
        assert_eq!(hw.nics(), 4);
        let nic = hw.inter_node.bandwidth;
        // A ring inside a node: NVLink.
        assert_eq!(hw.ring_link(1, 8, 64), hw.intra_node);
        // A flat ring of 64: one hop per node leaves it, on a NIC of its own.
        assert_eq!(hw.ring_link(1, 64, 64).bandwidth, nic);
        // Head-first hp 8 x cp 8: every rank's hop leaves the node, 2 per NIC.
        assert_eq!(hw.ring_link(8, 8, 64).bandwidth, nic / 2.0);
        // Double ring (cp 64, context-first): the outer ring of inner rings of 4 sends 4 hops out
        // of each node (one per NIC); of inner rings of 8 (stride 8, size 8: the hops above),
        // 8; of inner rings of 2, 2 (one NIC each).
        assert_eq!(hw.ring_link(4, 16, 64).bandwidth, nic);
        assert_eq!(hw.ring_link(2, 32, 64).bandwidth, nic);
        // Collectives of every device of a node across nodes: a device's share of the NICs.
        assert_eq!(hw.link(8, 8).bandwidth, nic / 2.0);
        let x = 1e9;
        assert_eq!(hw.all_to_all_time(8, 8, x, 0.0), x / (nic / 2.0));
        // Without a NIC count: one per device, as before.
        let one_each = Hardware {
            nics_per_node: None,
            ..hw.clone()
        };
        assert_eq!(one_each.ring_link(8, 8, 64).bandwidth, nic);
        assert_eq!(one_each.link(8, 8).bandwidth, nic);
        let e = Hardware::from_toml(
            &hw.to_toml()
                .unwrap()
                .replace("nics_per_node = 4", "nics_per_node = 0"),
            "nics.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("nics.toml") && e.contains("nics_per_node"),
            "{e}"
        );
    }
}
