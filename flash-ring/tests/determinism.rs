//! The backward is bit-reproducible whatever the thread timing: the same inputs give the same
//! bits on every call, on pools of any size, also while other threads compete for the cores.
//! (Multi-rank training ran several backwards at once and drifted by 1e-6 between runs when the
//! GQA heads of a kv head, or the key chunks of a q head, were summed in arrival order.)

mod common;

use candle_core::Tensor;
use common::Case;
use flash_ring::{AttnSpec, KernelConfig, MaskKind, Positions};

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 tensor")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// dq, dk, dv of `case` as bits, computed on a pool of `threads` threads.
fn grads(case: &Case, threads: usize) -> [Vec<u32>; 3] {
    common::on_threads(threads, || {
        let [q, k, v, dout] = case.tensors();
        let (out, lse) =
            flash_ring::flash_fwd_with_config(&q, &k, &v, &case.spec, &case.cfg).expect("fwd");
        let (dq, dk, dv) = flash_ring::flash_bwd_with_config(
            &q, &k, &v, &out, &lse, &dout, &case.spec, &case.cfg, true,
        )
        .expect("bwd");
        [bits(&dq), bits(&dk), bits(&dv)]
    })
}

#[test]
fn backward_bits_do_not_depend_on_timing() {
    let spec = |n| {
        AttnSpec::new(
            0.3,
            MaskKind::Causal,
            Positions::range(0, n),
            Positions::range(0, n),
        )
    };
    let small_tiles = KernelConfig {
        q_tile: 32,
        k_tile: 32,
        isa: None,
        ..KernelConfig::default()
    };
    // GQA (4 q heads on one kv head: dk/dv summed over heads) with few heads (several key chunks
    // per head: dq summed over chunks), and MHA with many heads (one chunk per head).
    let cases = [
        Case::new(1, 512, 512, 4, 1, 16, spec(512)).cfg(small_tiles.clone()),
        Case::new(2, 256, 256, 2, 2, 8, spec(256)).cfg(small_tiles),
        Case::new(1, 200, 200, 8, 2, 16, spec(200)),
    ];
    for (i, case) in cases.iter().enumerate() {
        for threads in [3, 8] {
            let first = grads(case, threads);
            // Repeat from four OS threads at once, each with its own pool, so that tasks finish
            // in varying orders.
            std::thread::scope(|s| {
                let runs: Vec<_> = (0..4).map(|_| s.spawn(|| grads(case, threads))).collect();
                for r in runs {
                    let again = r.join().expect("backward thread");
                    for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(first.iter().zip(&again)) {
                        assert!(
                            a == b,
                            "case {i}, {threads} threads: {name} differs between calls"
                        );
                    }
                }
            });
        }
    }
}
