//! Parallel layout flags shared by every `cpl` command, and `cpl plan`.

use anyhow::{bail, Context, Result};
use candle_parallel::mesh::{Dim, MeshConfig, MeshLayout, Placement};

#[derive(clap::Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Number of ranks (local threads, or MPI processes).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Head-parallel (Ulysses) degree.
    #[arg(long, default_value_t = 1)]
    pub ulysses: usize,
    /// Context-parallel (ring) degree.
    #[arg(long, default_value_t = 1)]
    pub ring: usize,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Data-parallel degree; inferred from --ranks when omitted.
    #[arg(long)]
    pub dp: Option<usize>,
    /// Rank order, innermost first, e.g. "tp,ulysses,ring,dp,pp" (default) or "tp,ulysses,ring,pp,dp" (Llama 3).
    #[arg(long)]
    pub order: Option<String>,
    /// Placement of the (ulysses, ring) grid: head-first or context-first (LoongTrain).
    #[arg(long, default_value = "head-first")]
    pub placement: String,
}

impl LayoutArgs {
    /// The mesh configuration these flags describe, validated against `--ranks`.
    pub fn mesh_config(&self) -> Result<MeshConfig> {
        if self.ranks == 0 {
            bail!("--ranks must be at least 1");
        }
        let mut cfg = MeshConfig::default()
            .with_tp(self.tp)
            .with_ulysses(self.ulysses)
            .with_ring(self.ring)
            .with_pp(self.pp);
        if let Some(order) = &self.order {
            let dims = Dim::parse_list(order).with_context(|| format!("--order {order:?}"))?;
            cfg = cfg.with_order(&dims);
            cfg.effective_order()
                .with_context(|| format!("--order {order:?}"))?;
        }
        let placement: Placement = self
            .placement
            .parse()
            .with_context(|| format!("--placement {:?}", self.placement))?;
        cfg = cfg.with_placement(placement);
        let dp = match self.dp {
            Some(dp) => dp,
            None => {
                let others = self.tp * self.ulysses * self.ring * self.pp;
                if others == 0 || self.ranks % others != 0 {
                    bail!(
                        "--ranks {} is not divisible by tp {} x ulysses {} x ring {} x pp {} = {others}; \
                         cannot infer --dp",
                        self.ranks, self.tp, self.ulysses, self.ring, self.pp
                    );
                }
                self.ranks / others
            }
        };
        let cfg = cfg.with_dp(dp);
        cfg.validate(self.ranks).context("parallel layout flags")?;
        Ok(cfg)
    }
}

/// `cpl plan`: prints the mesh, its rank order and groups.
pub fn plan(args: &LayoutArgs) -> Result<()> {
    let cfg = args.mesh_config()?;
    let layout = MeshLayout::new(&cfg, args.ranks)?;
    print!("{}", layout.describe());
    Ok(())
}
