//! `FLASH_RING_ISA` is read once per process, so it has a test binary of its own: set to an
//! instruction set this CPU has (the narrowest vector one), it becomes the kernels' default
//! (`detect`, `KernelConfig { isa: None, .. }`), and the default attention and product give
//! the bits of the same calls with that ISA named explicitly.

use candle_core::{Device, Tensor};
use flash_ring::{AttnSpec, KernelConfig, MaskKind};

#[test]
fn flash_ring_isa_picks_the_default_instruction_set() {
    let all = flash_ring::cpu::available();
    // The narrowest vector ISA (AVX2 on x86), else the portable code.
    let isa = all.iter().rev().nth(1).copied().unwrap_or(all[0]);
    // This binary's only test sets the variable before any kernel reads it.
    std::env::set_var(flash_ring::cpu::ISA_ENV, format!("{isa:?}").to_lowercase());
    assert_eq!(flash_ring::cpu::detect(), isa);
    let named = KernelConfig {
        isa: Some(isa),
        ..KernelConfig::default()
    };
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (1, 70, 2, 32), &dev).expect("q");
    let k = Tensor::randn(0f32, 1.0, (1, 70, 1, 32), &dev).expect("k");
    let spec = AttnSpec::dense(0.2, MaskKind::Causal, 70, 70);
    let (o1, l1) = flash_ring::flash_fwd_with_config(&q, &k, &k, &spec, &KernelConfig::default())
        .expect("fwd");
    let (o2, l2) = flash_ring::flash_fwd_with_config(&q, &k, &k, &spec, &named).expect("fwd");
    testkit::assert_identical(&o1, &o2, "attention output");
    testkit::assert_identical(&l1, &l2, "attention lse");
    let w = Tensor::randn(0f32, 1.0, (64, 32), &dev).expect("w");
    let x = q.reshape((140, 32)).expect("x");
    let p1 = flash_ring::matmul(&x, &w.t().expect("t")).expect("product");
    let p2 = flash_ring::matmul_with_config(&x, &w.t().expect("t"), &named).expect("product");
    testkit::assert_identical(&p1, &p2, "product");
}
