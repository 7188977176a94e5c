//! Pipeline parallelism (issue 13) against one rank: a LLaMA cut into stages and run by each
//! schedule (GPipe, 1F1B, interleaved 1F1B) over micro-batches gives the single-rank loss and
//! every parameter's gradient (f32, 1e-5 relative, per parameter), for pp 2 and 4, micro-batch
//! counts 1, 3, 4 and 6 (also not multiples of the stages, and fewer than the stages), the
//! default and explicit (uneven) layer splits, tied and untied embeddings, and pp combined with
//! tensor and ring parallelism. Every parameter must receive a non-zero gradient.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, Strategy};
use candle_parallel::comm::{LocalWorld, ReduceOp};
use candle_parallel::mesh::Dim;
use candle_parallel::nn::{Batch, CrossEntropyOptions, ParallelCtx, ParamMode};
use candle_parallel::optim::{collect_gradients, reduce_gradients};
use candle_parallel::pipeline::{
    run_stage_step, split_layers, PipelineSchedule, ScheduleKind, StageStep,
};
use cpl_integration_tests::{trainable_vars, Layout};
use models::llama;
use models::{LmStages, StageMicroBatch};

const LAYERS: usize = 6;
const VOCAB: usize = 96;
const SEQ: usize = 16;

/// The test checkpoint, written once per process (tests run in parallel).
fn model_dir(tied: bool) -> PathBuf {
    static DIRS: [OnceLock<PathBuf>; 2] = [OnceLock::new(), OnceLock::new()];
    DIRS[usize::from(tied)]
        .get_or_init(|| write_model(tied))
        .clone()
}

fn write_model(tied: bool) -> PathBuf {
    let name = if tied {
        "pipeline-tied"
    } else {
        "pipeline-untied"
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied, "torch_dtype": "float32"
    });
    llama::write_random_checkpoint(&dir, &config, if tied { 3 } else { 4 }).unwrap();
    dir
}

/// `m` micro-batches of one sequence each: ids and next-token labels (the last token of each
/// sequence and a few others unlabelled).
fn micro_batches(m: usize) -> Vec<(Vec<u32>, Vec<i64>)> {
    (0..m)
        .map(|i| {
            let ids: Vec<u32> = (0..SEQ)
                .map(|t| ((t * 31 + i * 17 + 5) % VOCAB) as u32)
                .collect();
            let labels = (0..SEQ)
                .map(|t| {
                    if t + 1 == SEQ || (t + i) % 7 == 3 {
                        -100
                    } else {
                        ids[t + 1] as i64
                    }
                })
                .collect();
            (ids, labels)
        })
        .collect()
}

fn global_tokens(micro: &[(Vec<u32>, Vec<i64>)]) -> u64 {
    micro
        .iter()
        .flat_map(|(_, l)| l)
        .filter(|&&l| l != -100)
        .count() as u64
}

/// One micro-batch (one sequence) as this rank's layout shards it.
fn stage_batch(ctx: &ParallelCtx, (ids, labels): &(Vec<u32>, Vec<i64>)) -> StageMicroBatch {
    let (batch, labels) = Batch::from_tokens(
        ctx,
        std::slice::from_ref(ids),
        std::slice::from_ref(labels),
        AttnMask::Causal,
    )
    .unwrap();
    StageMicroBatch { batch, labels }
}

struct Result1 {
    loss: f64,
    grads: HashMap<String, Tensor>,
}

/// The whole model on one rank: the loss summed over the micro-batches divided by the step's
/// labelled tokens, and every parameter's gradient.
fn single(tied: bool, micro: &[(Vec<u32>, Vec<i64>)]) -> Result1 {
    let files = models::hub::from_dir("pipeline", &model_dir(tied)).unwrap();
    let mut out = LocalWorld::run(1, |world| -> Result<Result1, String> {
        let (_, ctx) = Layout::single().context(world)?;
        let loaded = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Trainable)
            .map_err(|e| e.to_string())?;
        let total = global_tokens(micro) as f64;
        let (mut loss, mut acc): (f64, Vec<(String, Tensor)>) = (0.0, Vec::new());
        for mb in micro {
            let StageMicroBatch { batch, labels } = stage_batch(&ctx, mb);
            let (sum, _) = loaded
                .model
                .loss_sum(&batch, &labels, &CrossEntropyOptions::default())
                .unwrap();
            loss += sum
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            let store = loaded.model.backward(&(sum / total).unwrap()).unwrap();
            let grads = collect_gradients(&loaded.params.sorted(), &store).unwrap();
            candle_parallel::optim::accumulate(&mut acc, grads).unwrap();
        }
        Ok(Result1 {
            loss: loss / total,
            grads: acc.into_iter().collect(),
        })
    })
    .unwrap();
    out.swap_remove(0)
}

/// The same step under `layout` (with its pp degree) and `kind` with `chunks` per rank and
/// optional explicit layers per virtual stage; the gradients gathered to whole tensors.
fn pipelined(
    tied: bool,
    layout: &Layout,
    kind: ScheduleKind,
    chunks: usize,
    layers: Option<&[usize]>,
    micro: &[(Vec<u32>, Vec<i64>)],
) -> Result1 {
    let files = models::hub::from_dir("pipeline", &model_dir(tied)).unwrap();
    let pp = layout.mesh.pp;
    let schedule = PipelineSchedule::new(kind, pp, micro.len(), chunks).unwrap();
    let split: Vec<Range<usize>> = split_layers(LAYERS, pp * chunks, layers).unwrap();
    let results = LocalWorld::run(layout.ranks, |world| -> Result<Result1, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let pp_comm = mesh.comm(Dim::Pp);
        let rank = pp_comm.rank();
        let mine: Vec<Range<usize>> = (0..chunks)
            .map(|c| split[schedule.virtual_stage(rank, c)].clone())
            .collect();
        let ends = rank == 0 || rank == pp - 1;
        let loaded = llama::load_stage(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            &mine,
            ends,
        )
        .map_err(|x| e(&x))?;
        let stage_micro: Vec<StageMicroBatch> =
            micro.iter().map(|mb| stage_batch(&ctx, mb)).collect();
        let params = loaded.params.sorted();
        let step = StageStep {
            schedule: &schedule,
            layers: &split,
            pp: &pp_comm,
            global_count: global_tokens(micro),
            dtype: DType::F32,
        };
        let staged = LmStages {
            model: &loaded.model,
            opts: CrossEntropyOptions::default(),
            balancing_loss: true,
        };
        let out = run_stage_step(&staged, &step, &stage_micro, trainable_vars(&params), 0)
            .map_err(|x| e(&x))?;
        let (grads, loss) = (out.grads, out.loss_sum);
        // Every parameter this rank holds has a gradient.
        let list: Vec<(String, Tensor)> = params
            .iter()
            .map(|p| {
                grads
                    .get(&p.name)
                    .cloned()
                    .map(|g| (p.name.clone(), g))
                    .ok_or_else(|| e(&format!("rank {rank}: no gradient for {}", p.name)))
            })
            .collect::<Result<_, _>>()?;
        // Sum over the sequence ranks, gather tensor-parallel slices.
        let reduced = reduce_gradients(&params, list, &ctx).map_err(|x| e(&x))?;
        let tp = mesh.comm(Dim::Tp);
        let mut whole = HashMap::new();
        for (p, (n, g)) in params.iter().zip(reduced) {
            let g = if p.shard.is_split() {
                tp.all_gather(&g.contiguous().unwrap(), p.shard.dim)
                    .unwrap()
            } else {
                g
            };
            whole.insert(n, g);
        }
        let seq = mesh.group(&[Dim::Ulysses, Dim::Ring]).map_err(|x| e(&x))?;
        let loss = seq
            .all_reduce(&Tensor::new(&[loss], &Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        Ok(Result1 {
            loss: loss / global_tokens(micro) as f64,
            grads: whole,
        })
    })
    .unwrap_or_else(|x| panic!("{x}"));
    // Merge the stages: each parameter from a rank that holds it; replicas must agree bit for
    // bit (the ends on the first and last stage, tp / ring replicas).
    let mut grads: HashMap<String, Tensor> = HashMap::new();
    for r in &results {
        for (n, g) in &r.grads {
            match grads.get(n) {
                Some(prev) => {
                    testkit::assert_identical(prev, g, &format!("{}: {n} replicas", layout.name))
                }
                None => {
                    grads.insert(n.clone(), g.clone());
                }
            }
        }
        assert_eq!(
            r.loss.to_bits(),
            results[0].loss.to_bits(),
            "{}: losses differ",
            layout.name
        );
    }
    Result1 {
        loss: results[0].loss,
        grads,
    }
}

fn check(what: &str, got: &Result1, want: &Result1) {
    testkit::assert_close_scalar(got.loss, want.loss, 1e-5, &format!("{what}: loss"));
    let mut names: Vec<&String> = want.grads.keys().collect();
    names.sort();
    let mut ours: Vec<&String> = got.grads.keys().collect();
    ours.sort();
    assert_eq!(ours, names, "{what}: parameters with gradients");
    for n in names {
        let (g, w) = (&got.grads[n], &want.grads[n]);
        assert!(testkit::max_abs(g) > 0.0, "{what}: gradient of {n} is zero");
        testkit::assert_close(g, w, 1e-5, &format!("{what}: gradient of {n}"));
    }
}

#[test]
fn every_schedule_matches_one_rank() {
    for tied in [false, true] {
        for m in [1, 3, 4, 6] {
            let micro = micro_batches(m);
            let want = single(tied, &micro);
            for pp in [2, 4] {
                let layout = Layout::single().with_pp(pp);
                for (kind, v) in [
                    (ScheduleKind::GPipe, 1),
                    (ScheduleKind::OneFOneB, 1),
                    (ScheduleKind::Interleaved, 2),
                ] {
                    if pp * v > LAYERS + 2 {
                        continue;
                    }
                    let what = format!("tied={tied} m={m} pp={pp} {kind} v={v}");
                    let got = pipelined(tied, &layout, kind, v, None, &micro);
                    check(&what, &got, &want);
                }
            }
        }
    }
}

#[test]
fn uneven_explicit_stages_match_one_rank() {
    let micro = micro_batches(3);
    for tied in [false, true] {
        let want = single(tied, &micro);
        let layout = Layout::single().with_pp(2);
        let got = pipelined(
            tied,
            &layout,
            ScheduleKind::OneFOneB,
            1,
            Some(&[5, 1]),
            &micro,
        );
        check(&format!("tied={tied} layers 5,1"), &got, &want);
        let layout = Layout::single().with_pp(4);
        let got = pipelined(
            tied,
            &layout,
            ScheduleKind::OneFOneB,
            1,
            Some(&[0, 4, 1, 1]),
            &micro,
        );
        check(&format!("tied={tied} layers 0,4,1,1"), &got, &want);
    }
}

#[test]
fn pipeline_composes_with_tensor_and_ring_parallelism() {
    let micro = micro_batches(3);
    let want = single(true, &micro);
    for layout in [
        Layout::new("pp2 x tp2", 2, 1, 1, Strategy::Ring).with_pp(2),
        Layout::new("pp2 x ring2 zigzag", 1, 1, 2, Strategy::Ring).with_pp(2),
        Layout::new("pp2 x ulysses2", 1, 2, 1, Strategy::Ulysses).with_pp(2),
    ] {
        let got = pipelined(true, &layout, ScheduleKind::OneFOneB, 1, None, &micro);
        check(layout.name, &got, &want);
    }
}
