use super::*;

/// u16 quantization without `roundf` gives [`quantize_one`]'s values: ties, saturation, NaN.
#[test]
fn quantize_u16_is_quantize_one() {
    let mut v: Vec<f32> = (0..200_000).map(|i| (i as f32 - 100_000.0) * 0.013).collect();
    v.extend([0.5, 1.5, -0.5, 2.5 * 0.02, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30]);
    for q in [Quant { scale: 0.02, offset: -32768 }, Quant { scale: 0.001, offset: 0 }, Quant { scale: 1.0, offset: -65535 }, Quant { scale: 0.5, offset: 7 }] {
        let want: Vec<u16> = v.iter().map(|&x| quantize_one(x, q, 0, 65535) as u16).collect();
        assert_eq!(quantize_u16(&v, q), want, "{q:?}");
    }
}

fn fc_graph(x_dtype: DType, w_dtype: DType) -> Graph {
    let mut g = Graph::new("t");
    let x = g.input("x", &[2, 4], x_dtype, x_dtype.is_quantized().then_some(Quant::u8_range(-1.0, 1.0)));
    let data = match w_dtype {
        DType::I8 => StaticData::I8(Arc::new(vec![1; 12])),
        _ => StaticData::F32(Arc::new(vec![1.0; 12])),
    };
    let w = g.constant("w", &[3, 4], data, w_dtype.is_quantized().then_some(Quant::symmetric(0.1)));
    let y = g.fully_connected("y", x, w, None, DType::F32, None);
    g.mark_output(y);
    g
}

/// An LPBQ weight's values must be 4-bit values times their block's scale, into a U8 or U16
/// output; the fingerprint tells block scales apart.
#[test]
fn lpbq_weights_are_checked() {
    let build = |values: Vec<i8>, scales: Vec<u8>, out: DType| {
        let mut g = Graph::new("lpbq");
        let x = g.input("x", &[2, 64], DType::U16, Some(Quant::u16_range(-1.0, 1.0)));
        let blocks = Arc::new(BlockScales { block: 32, scales });
        let w = g.constant_lpbq("w", &[2, 64], Arc::new(values), Arc::new(vec![0.1, 0.2]), blocks);
        let y = g.fully_connected("y", x, w, None, out, (out == DType::U16).then(|| Quant::u16_range(-9.0, 9.0)));
        g.mark_output(y);
        g
    };
    // Block scales 3, 1 / 15, 2: values multiples of them within [-8, 7] of them.
    let mut v: Vec<i8> = (0..128).map(|i| [-24i8, 21, -8, 7, -120, 105, -16, 14][(i / 32) * 2 + i % 2]).collect();
    let scales = vec![3, 1, 15, 2];
    build(v.clone(), scales.clone(), DType::U16).validate().unwrap();
    let fp = build(v.clone(), scales.clone(), DType::U16).fingerprint();
    assert_ne!(fp, build(v.iter().map(|&q| q / 3 * 3).collect::<Vec<_>>(), vec![3, 3, 15, 2], DType::U16).fingerprint());
    let reason = |g: Graph| match g.validate() {
        Err(Error::InvalidGraph { reason, .. }) => reason,
        other => panic!("expected InvalidGraph, got {other:?}"),
    };
    assert!(reason(build(v.clone(), scales.clone(), DType::F32)).contains("U8 or U16 output"));
    assert!(reason(build(v.clone(), vec![3, 1, 15], DType::U16)).contains("one block scale per 32"));
    assert!(reason(build(v.clone(), vec![3, 1, 16, 2], DType::U16)).contains("1..=15"));
    v[0] = -25; // the first block's scale is 3: not a multiple of it
    assert!(reason(build(v.clone(), scales.clone(), DType::U16)).contains("at [0, 0]"));
    v[0] = -27; // a multiple of 3, but -9 is not a 4-bit value
    assert!(reason(build(v, scales, DType::U16)).contains("at [0, 0]"));
}

#[test]
fn valid_graphs_pass() {
    fc_graph(DType::F32, DType::F32).validate().unwrap();
    fc_graph(DType::U8, DType::I8).validate().unwrap();
}

#[test]
fn mixed_precision_fc_is_rejected_with_shapes() {
    let err = fc_graph(DType::F32, DType::I8).validate().unwrap_err().to_string();
    assert!(err.contains("FullyConnected") && err.contains("[2, 4]") && err.contains("[3, 4]"), "{err}");
}

#[test]
fn shape_mismatch_is_rejected() {
    let mut g = Graph::new("t");
    let x = g.input("x", &[2, 5], DType::F32, None);
    let w = g.constant("w", &[3, 4], StaticData::F32(Arc::new(vec![0.0; 12])), None);
    let y = g.fully_connected("y", x, w, None, DType::F32, None);
    g.mark_output(y);
    assert!(g.validate().unwrap_err().to_string().contains("input [M, K]"));
}

#[test]
fn wrong_bias_scale_and_missing_quant_are_rejected() {
    let mut g = fc_graph(DType::U8, DType::I8);
    let b = g.constant("b", &[3], StaticData::I32(Arc::new(vec![0; 3])), Some(Quant::symmetric(1.0)));
    if let Op::FullyConnected { bias, .. } = &mut g.ops[0] {
        *bias = Some(b);
    }
    assert!(g.validate().unwrap_err().to_string().contains("s_in * s_w"));

    let mut g = Graph::new("t");
    let x = g.input("x", &[1, 1], DType::U8, None);
    g.mark_output(x);
    assert!(g.validate().unwrap_err().to_string().contains("without scale"));
}

#[test]
fn use_before_definition_and_no_output_are_rejected() {
    let mut g = Graph::new("t");
    let a = g.input("a", &[4], DType::F32, None);
    let dangling = g.tensor_new("d", &[4], DType::F32, None);
    let y = g.binary("y", a, dangling, DType::F32, None, |a, b, output| Op::Add { a, b, output });
    g.mark_output(y);
    assert!(g.validate().unwrap_err().to_string().contains("before it is produced"));
    assert!(Graph::new("empty").validate().unwrap_err().to_string().contains("no outputs"));
}

#[test]
fn malformed_structure_is_an_error_not_a_panic() {
    type Edit = fn(&mut Graph);
    let cases: [(Edit, &str); 9] = [
        (|g| g.outputs.push(TensorId(99)), "out of range"),
        (|g| g.inputs.push(TensorId(99)), "out of range"),
        (|g| g.ops.push(Op::Sigmoid { input: TensorId(0), output: TensorId(1000) }), "tensor id 1000 out of range"),
        (|g| g.outputs.push(g.outputs[0]), "listed twice"),
        (|g| g.inputs.clear(), "the graph's inputs"),
        (|g| g.tensors[1].data = None, "constant without data"),
        (|g| g.tensors[1].dtype = DType::I32, "constant data is F32, the tensor I32"),
        (|g| g.tensors[0].shape = vec![1 << 40, 1 << 40], "beyond 4294967295 bytes"),
        (|g| g.ops.push(g.ops[0].clone()), "another op produces"),
    ];
    for (edit, why) in cases {
        let mut g = fc_graph(DType::F32, DType::F32);
        edit(&mut g);
        let err = g.validate().unwrap_err().to_string();
        assert!(err.contains(why) && err.contains("graph 't'"), "{why}: {err}");
    }
    // An op writing a constant, or its own input.
    let mut g = fc_graph(DType::F32, DType::F32);
    g.ops.push(Op::Sigmoid { input: TensorId(0), output: TensorId(1) });
    assert!(g.validate().unwrap_err().to_string().contains("writes an input or a constant"));
    // Quantizing +inf under a negative offset saturates at the top, never wraps to the bottom.
    assert_eq!(quantize_one(f32::INFINITY, Quant { scale: 1.0, offset: -128 }, 0, 255), 255);
}

/// Batched MatMul: one batch dimension, equal on both operands and the output; a softmax
/// keeps its input's shape and F32.
#[test]
fn attention_ops_check_their_shapes() {
    let graph = |a: &[usize], b: &[usize], out: &[usize], soft: DType| {
        let mut g = Graph::new("t");
        let (a, b) = (g.input("a", a, DType::F32, None), g.input("b", b, DType::F32, None));
        let s = g.op("s", DType::F32, None, |output| Op::MatMul { a, b, transpose_b: true, output }, out);
        let p = g.op("p", soft, Some(Quant::u8_range(0.0, 1.0)).filter(|_| soft != DType::F32), |output| Op::Softmax { input: s, output }, out);
        g.mark_output(p);
        g.validate().map(|_| ()).map_err(|e| e.to_string())
    };
    assert_eq!(graph(&[3, 8, 4], &[3, 5, 4], &[3, 8, 5], DType::F32), Ok(()));
    assert_eq!(graph(&[8, 4], &[5, 4], &[8, 5], DType::F32), Ok(()));
    for (a, b, out, soft, why) in [
        (&[3, 8, 4][..], &[2, 5, 4][..], &[3, 8, 5][..], DType::F32, "batch dimensions differ"),
        (&[3, 8, 4], &[5, 4], &[3, 8, 5], DType::F32, "of one rank, 2 or 3"),
        (&[2, 3, 8, 4], &[2, 3, 5, 4], &[2, 3, 8, 5], DType::F32, "of one rank, 2 or 3"),
        (&[3, 8, 4], &[3, 5, 4], &[8, 5], DType::F32, "inner dimensions differ"),
        (&[3, 8, 4], &[3, 5, 4], &[3, 8, 5], DType::U8, "Softmax maps F32 to F32"),
    ] {
        let err = graph(a, b, out, soft).unwrap_err();
        assert!(err.contains(why), "{a:?} x {b:?} -> {out:?}: {err}");
    }
}

#[test]
fn u8_range_includes_zero_exactly() {
    for (lo, hi) in [(-3.0, 5.0), (0.5, 7.0), (-9.0, -1.0), (-1e-3, 1e-3)] {
        let q = Quant::u8_range(lo, hi);
        let back = TensorData::from_f32(&[0.0], DType::U8, Some(q)).to_f32(Some(q));
        assert_eq!(back[0], 0.0, "zero not exact for [{lo}, {hi}]: {q:?}");
        let (flo, fhi) = q.float_range(DType::U8);
        assert!(flo <= lo.min(0.0) + q.scale && fhi >= hi.max(0.0) - q.scale, "{q:?} does not cover [{lo}, {hi}]");
    }
}
