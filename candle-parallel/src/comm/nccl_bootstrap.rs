//! How NCCL communicators find each other: host logic only, compiled in every build and tested
//! on the local backend; the NCCL communicator (`comm::nccl`, feature `nccl`) runs it.
//!
//! - **World.** Every rank of a job must call `ncclCommInitRank` with the same 128-byte unique
//!   id. Rank 0 creates it; it reaches the other ranks through a rendezvous file
//!   ([`publish_id`] / [`wait_for_id`]; the local processes `cpl --backend nccl` spawns, or the
//!   ranks of an `mpirun` job, on a filesystem they share): rank 0 writes the file atomically
//!   (temporary file, then rename), the others poll until it appears or a timeout passes.
//! - **Sub-groups** (one per mesh dimension: tp, ulysses, ring, pp, dp). `ncclCommSplit` is not
//!   bound for every CUDA version, so each group gets its own id: [`split_ids`] is a collective
//!   over the parent communicator (NCCL itself, on the parent's device) that all-gathers every
//!   rank's `(color, key)`, lets the first member of each group create that group's id, and
//!   all-gathers the ids, so every rank learns its group, its rank in it (ordered by key, then by
//!   parent rank, as [`Communicator::split`] promises) and the id to initialise it with.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::{plan_split, Communicator, SplitPlan};
use crate::error::{Error, Result};

/// Size of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// An NCCL unique id, as bytes.
pub type UniqueId = [u8; ID_BYTES];

/// Collective over `parent` (every rank calls it, in the same order as its other collectives):
/// returns this rank's group and the group's id, created by `new_id` on the group's first
/// member only. The exchange tensors live on `device` (the parent communicator's device).
pub fn split_ids(
    parent: &dyn Communicator,
    color: usize,
    key: usize,
    device: &Device,
    new_id: impl FnOnce() -> Result<UniqueId>,
) -> Result<(SplitPlan, UniqueId)> {
    let as_u32 = |what: &str, v: usize| {
        u32::try_from(v).map_err(|_| {
            Error::invalid(
                "split",
                format!("{what} {v} does not fit the 32-bit exchange"),
            )
        })
    };
    let mine = Tensor::new(&[as_u32("color", color)?, as_u32("key", key)?], device)?;
    let all: Vec<u32> = parent.all_gather(&mine, 0)?.to_vec1()?;
    let entries: Vec<(usize, usize)> = all
        .chunks_exact(2)
        .map(|c| (c[0] as usize, c[1] as usize))
        .collect();
    if entries.len() != parent.size() {
        return Err(Error::invalid(
            "split",
            format!(
                "gathered {} (color, key) pairs from {} ranks",
                entries.len(),
                parent.size()
            ),
        ));
    }
    let plan = plan_split(&entries, parent.rank())?;
    let id = if plan.is_leader() {
        new_id()?
    } else {
        [0u8; ID_BYTES]
    };
    let ids: Vec<u8> = parent
        .all_gather(&Tensor::new(&id[..], device)?, 0)?
        .to_vec1()?;
    let leader = plan.members[0];
    let mut out = [0u8; ID_BYTES];
    out.copy_from_slice(&ids[leader * ID_BYTES..(leader + 1) * ID_BYTES]);
    Ok((plan, out))
}

/// Writes `id` to `path` atomically (a temporary file in the same folder, then a rename), so a
/// rank polling [`wait_for_id`] never reads a partial id.
pub fn publish_id(path: &Path, id: &UniqueId) -> Result<()> {
    let io = |what: &str, e: std::io::Error| {
        Error::invalid("nccl rendezvous", format!("{what} {}: {e}", path.display()))
    };
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| io("cannot create", e))?;
    f.write_all(id).map_err(|e| io("cannot write", e))?;
    f.sync_all().map_err(|e| io("cannot sync", e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| io("cannot rename into", e))
}

/// Waits until `path` holds an id written by [`publish_id`]; errors after `timeout`, or when the
/// file exists with the wrong size (a stale or foreign file).
pub fn wait_for_id(path: &Path, timeout: Duration) -> Result<UniqueId> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                let id: UniqueId = bytes.as_slice().try_into().map_err(|_| {
                    Error::invalid(
                        "nccl rendezvous",
                        format!(
                            "{} holds {} bytes, not a {ID_BYTES}-byte NCCL id",
                            path.display(),
                            bytes.len()
                        ),
                    )
                })?;
                return Ok(id);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::invalid(
                    "nccl rendezvous",
                    format!("cannot read {}: {e}", path.display()),
                ))
            }
        }
        if start.elapsed() >= timeout {
            return Err(Error::invalid(
                "nccl rendezvous",
                format!(
                    "no NCCL id appeared at {} within {:.1}s (did rank 0 start?)",
                    path.display(),
                    timeout.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalWorld;
    use std::sync::atomic::{AtomicU8, Ordering};

    #[test]
    fn plan_orders_by_key_then_rank() {
        let entries = [(1, 5), (0, 0), (1, 2), (0, 0), (1, 2)];
        let p = plan_split(&entries, 0).unwrap();
        assert_eq!(p.members, vec![2, 4, 0]);
        assert_eq!(p.rank, 2);
        assert!(!p.is_leader());
        let p = plan_split(&entries, 3).unwrap();
        assert_eq!(p.members, vec![1, 3]);
        assert_eq!((p.rank, p.size()), (1, 2));
        assert!(plan_split(&entries, 5).is_err());
    }

    /// The mesh of a tp2 x ring2 x dp2 world: every group's members agree on one id, different
    /// groups get different ids, only leaders create ids, and the groups equal the local
    /// backend's own split.
    #[test]
    fn split_ids_over_the_local_backend() {
        let created = AtomicU8::new(1);
        let out = LocalWorld::run(8, |world| -> Result<_> {
            let r = world.rank();
            let mut res = Vec::new();
            // Colors of the three mesh dimensions (tp fastest).
            for (color, key) in [(r / 2, r), (r % 2 + 2 * (r / 4), r), (r % 4, r)] {
                let (plan, id) = split_ids(world.as_ref(), color, key, &Device::Cpu, || {
                    let n = created.fetch_add(1, Ordering::SeqCst);
                    Ok([n; ID_BYTES])
                })?;
                let local = world.split(color, key)?;
                assert_eq!(plan.rank, local.rank(), "rank in group");
                assert_eq!(plan.size(), local.size(), "group size");
                res.push((color, plan, id));
            }
            Ok(res)
        })
        .unwrap();
        // 4 groups of 2 in each of the 3 dims: 12 ids created, each by one leader (the counter
        // started at 1).
        assert_eq!(created.load(Ordering::SeqCst), 13);
        for dim in 0..3 {
            let mut seen = std::collections::BTreeMap::new();
            for (r, rank_res) in out.iter().enumerate() {
                let (color, plan, id) = &rank_res[dim];
                assert!(plan.members.contains(&r));
                assert!(id.iter().all(|&b| b == id[0] && b != 0), "a real id");
                let prev = seen.insert(*color, (id[0], plan.members.clone()));
                if let Some(prev) = prev {
                    assert_eq!(prev, (id[0], plan.members.clone()), "one id per group");
                }
            }
            let ids: std::collections::BTreeSet<u8> = seen.values().map(|v| v.0).collect();
            assert_eq!(ids.len(), seen.len(), "groups have distinct ids");
        }
    }

    #[test]
    fn split_ids_reports_a_failing_id_source() {
        let res = LocalWorld::run(2, |world| -> Result<_> {
            split_ids(world.as_ref(), 0, world.rank(), &Device::Cpu, || {
                Err(Error::invalid("ncclGetUniqueId", "no GPU"))
            })
        });
        let msg = res.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("no GPU"), "{msg}");
    }

    #[test]
    fn rendezvous_file_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("cpl-nccl-rdv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("id");
        let _ = std::fs::remove_file(&path);
        let id: UniqueId = std::array::from_fn(|i| i as u8);
        let waiter = {
            let path = path.clone();
            std::thread::spawn(move || wait_for_id(&path, Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(50));
        publish_id(&path, &id).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), id);
        // A wrong-size file names itself.
        std::fs::write(&path, [1u8; 7]).unwrap();
        let e = wait_for_id(&path, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("7 bytes") && e.contains(&path.display().to_string()),
            "{e}"
        );
        // No file: a timeout naming the path.
        std::fs::remove_file(&path).unwrap();
        let e = wait_for_id(&path, Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(e.contains("within") && e.contains("rank 0"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
