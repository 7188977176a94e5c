//! The cluster the planner plans for, as a TOML file.
//!
//! ```toml
//! name = "8x H100 SXM (NVLink 4)"
//! nodes = 1
//! devices_per_node = 8
//! # true for local ranks of one CPU: the devices of a node share its compute and memory, so
//! # the rates and the memory below are the node's, split among the ranks that run on it.
//! shared_node = false
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
//! [inter_node]
//! bandwidth = 4.5e10
//! latency = 1.0e-5
//!
//! overlap = true               # ring transfers overlap the block compute
//! ```
//!
//! Presets ([`Hardware::preset`]) describe an 8-GPU NVLink node, a cluster of 8 of them over
//! InfiniBand, and the 2-core development machine as `cpl bench --calibrate` measured it.
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

/// One kind of link: bandwidth per device and direction, and latency per message.
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
    pub inter_node: LinkSpec,
    /// Ring transfers run while the previous block computes (GPUs with a copy engine); without,
    /// every transfer is exposed (local CPU ranks, whose cores do the copies).
    #[serde(default = "yes")]
    pub overlap: bool,
}

fn yes() -> bool {
    true
}

/// The built-in hardware descriptions: `(name, TOML)`.
const PRESETS: [(&str, &str); 3] = [
    ("h100-node", include_str!("presets/h100-node.toml")),
    ("h100-cluster", include_str!("presets/h100-cluster.toml")),
    ("cpu-2core", include_str!("presets/cpu-2core.toml")),
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

    /// The link a group of `size` ranks spaced `stride` apart in rank order uses (the groups
    /// of a mesh dimension tile the ranks): the intra-node link when every such group lies in
    /// one node, the inter-node link when some group spans nodes.
    pub fn link(&self, stride: usize, size: usize) -> &LinkSpec {
        let span = stride * size;
        if size <= 1 || span <= self.devices_per_node && self.devices_per_node.is_multiple_of(span)
        {
            &self.intra_node
        } else {
            &self.inter_node
        }
    }

    /// Seconds of an all-to-all in which each of `size` ranks spaced `stride` apart sends
    /// `bytes` (to its `size - 1` peers alike) in `messages` messages: the share for peers on
    /// the same node moves at the intra-node rate while the rest crosses nodes, at the same
    /// time.
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
            .max(bytes * remote / self.inter_node.bandwidth)
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
        assert_eq!(hw.link(1, 8), &hw.intra_node);
        assert_eq!(hw.link(2, 4), &hw.intra_node);
        assert_eq!(hw.link(1, 16), &hw.inter_node);
        assert_eq!(hw.link(8, 2), &hw.inter_node);
        assert_eq!(hw.link(64, 1), &hw.intra_node);
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
}
