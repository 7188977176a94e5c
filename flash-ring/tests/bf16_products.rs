//! Where bf16 products run (`flash_ring::Bf16Products`, `gemm_bf16::used_under`): the rule by
//! CPU and choice, the vendor check against `/proc/cpuinfo`, the choices' parsing, and that a
//! widened bf16 product or attention gives the bits of the f32 computation of the same values
//! (on every instruction set of this machine).

mod common;

use candle_core::{DType, Device, Tensor};
use flash_ring::cpu::gemm_bf16::{dot_products_on, intel};
use flash_ring::{AttnSpec, Bf16Products, Isa, KernelConfig, MaskKind};

/// The dot products only under the AVX-512 kernels on a CPU with the instruction; by default on
/// Intel's CPUs only for products of a few rows.
#[test]
fn dot_products_only_under_avx512_with_the_instruction_and_on_intel_for_few_rows() {
    use Bf16Products::{Auto, Dot, Widen};
    for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
        for has in [false, true] {
            for is_intel in [false, true] {
                for few in [false, true] {
                    let possible = isa == Isa::Avx512 && has;
                    let at = format!("{isa:?} avx512bf16={has} intel={is_intel} few={few}");
                    assert_eq!(
                        dot_products_on(isa, Dot, has, is_intel, few),
                        possible,
                        "{at}"
                    );
                    assert!(!dot_products_on(isa, Widen, has, is_intel, few), "{at}");
                    assert_eq!(
                        dot_products_on(isa, Auto, has, is_intel, few),
                        possible && (few || !is_intel),
                        "{at}"
                    );
                }
            }
        }
    }
}

#[test]
fn intel_is_the_cpuid_vendor_of_proc_cpuinfo() {
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return testkit::skip(
            "flash-ring/bf16_products::intel_is_the_cpuid_vendor_of_proc_cpuinfo",
            "no /proc/cpuinfo",
        );
    };
    let vendor = info
        .lines()
        .find_map(|l| l.strip_prefix("vendor_id"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string());
    let Some(vendor) = vendor else {
        // Not x86 (no vendor_id line): never Intel's.
        assert!(!intel());
        return;
    };
    assert_eq!(intel(), vendor == "GenuineIntel", "vendor_id {vendor}");
}

#[test]
fn choices_parse_and_a_bad_one_lists_them() {
    assert_eq!(
        "auto".parse::<Bf16Products>().ok(),
        Some(Bf16Products::Auto)
    );
    assert_eq!("DOT".parse::<Bf16Products>().ok(), Some(Bf16Products::Dot));
    assert_eq!(
        "widen".parse::<Bf16Products>().ok(),
        Some(Bf16Products::Widen)
    );
    let e = "fast".parse::<Bf16Products>().expect_err("bad").to_string();
    assert!(
        e.contains("\"fast\"") && e.contains("auto, dot or widen"),
        "{e}"
    );
}

fn widen_on(isa: Isa) -> KernelConfig {
    KernelConfig {
        isa: Some(isa),
        bf16: Bf16Products::Widen,
        ..KernelConfig::default()
    }
}

/// Random non-zero bf16 values and their f32 copies (the same numbers).
fn pair(shape: &[usize], seed: u64) -> (Tensor, Tensor) {
    let n = shape.iter().product();
    let v = common::randv(&mut common::rng(seed), n);
    let f = Tensor::from_vec(v, shape, &Device::Cpu).expect("f32");
    let b = f.to_dtype(DType::BF16).expect("bf16");
    let f = b.to_dtype(DType::F32).expect("widened");
    (b, f)
}

#[test]
fn a_widened_bf16_product_is_the_f32_product_of_the_same_values() {
    for (m, k, n) in [(1, 64, 40), (37, 300, 130), (200, 96, 70)] {
        let (xb, xf) = pair(&[m, k], 1);
        let (wb, wf) = pair(&[n, k], 2);
        for isa in flash_ring::cpu::available() {
            let cfg = widen_on(isa);
            let got = flash_ring::matmul_with_config(&xb, &wb.t().expect("t"), &cfg).expect("bf16");
            let f32 = flash_ring::matmul_with_config(&xf, &wf.t().expect("t"), &cfg).expect("f32");
            assert_eq!(got.dtype(), DType::BF16);
            let want = f32.to_dtype(DType::BF16).expect("rounded");
            testkit::assert_identical(&got, &want, &format!("{isa:?} {m}x{k}x{n}"));
            assert!(testkit::max_abs(&got) > 0.0, "{isa:?}: all zero");
        }
    }
    // Views the widening compacts (more gaps than elements: columns of a wide matrix) and a
    // column-major one it converts in place, against the f32 product of the same views.
    let (xb, xf) = pair(&[37, 1200], 7);
    let (wb, wf) = pair(&[300, 90], 8);
    for isa in flash_ring::cpu::available() {
        let cfg = widen_on(isa);
        let narrow = |x: &Tensor| x.narrow(1, 100, 300).expect("narrow");
        let got = flash_ring::matmul_with_config(&narrow(&xb), &wb, &cfg).expect("bf16");
        let f32 = flash_ring::matmul_with_config(&narrow(&xf), &wf, &cfg).expect("f32");
        let want = f32.to_dtype(DType::BF16).expect("rounded");
        testkit::assert_identical(&got, &want, &format!("{isa:?} narrowed columns"));
        let t = |x: &Tensor| {
            x.t()
                .and_then(|x| x.contiguous())
                .and_then(|x| x.t())
                .expect("t")
        };
        let got = flash_ring::matmul_with_config(&narrow(&xb), &t(&wb), &cfg).expect("bf16");
        let f32 = flash_ring::matmul_with_config(&narrow(&xf), &t(&wf), &cfg).expect("f32");
        let want = f32.to_dtype(DType::BF16).expect("rounded");
        testkit::assert_identical(&got, &want, &format!("{isa:?} column-major b"));
    }
}

#[test]
fn widened_bf16_attention_is_the_f32_attention_of_the_same_values() {
    let (b, s, hq, hkv, d) = (1, 150, 4, 2, 64);
    let (qb, qf) = pair(&[b, s, hq, d], 3);
    let (kb, kf) = pair(&[b, s, hkv, d], 4);
    let (vb, vf) = pair(&[b, s, hkv, d], 5);
    let (db, df) = pair(&[b, s, hq, d], 6);
    let spec = AttnSpec::dense(1.0 / (d as f32).sqrt(), MaskKind::Causal, s, s);
    for isa in flash_ring::cpu::available() {
        let cfg = widen_on(isa);
        let (ob, lb) = flash_ring::flash_fwd_with_config(&qb, &kb, &vb, &spec, &cfg).expect("fwd");
        let (of, lf) = flash_ring::flash_fwd_with_config(&qf, &kf, &vf, &spec, &cfg).expect("fwd");
        assert_eq!(ob.dtype(), DType::BF16);
        let of_b = of.to_dtype(DType::BF16).expect("rounded");
        testkit::assert_identical(&ob, &of_b, &format!("{isa:?} out"));
        testkit::assert_identical(&lb, &lf, &format!("{isa:?} lse"));
        // The backward of the bf16 run against the f32 backward given the same (bf16) out.
        let ob_f = ob.to_dtype(DType::F32).expect("out");
        let gb = flash_ring::flash_bwd_with_config(&qb, &kb, &vb, &ob, &lb, &db, &spec, &cfg, true)
            .expect("bwd");
        let gf =
            flash_ring::flash_bwd_with_config(&qf, &kf, &vf, &ob_f, &lb, &df, &spec, &cfg, true)
                .expect("bwd");
        for (name, x, y) in [
            ("dq", &gb.0, &gf.0),
            ("dk", &gb.1, &gf.1),
            ("dv", &gb.2, &gf.2),
        ] {
            let y = y.to_dtype(x.dtype()).expect("rounded");
            testkit::assert_identical(x, &y, &format!("{isa:?} {name}"));
            assert!(testkit::max_abs(x) > 0.0, "{isa:?} {name}: all zero");
        }
    }
}
