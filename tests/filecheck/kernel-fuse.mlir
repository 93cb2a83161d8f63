// RUN: hspmd-opt %s -p fuse-kernels | filecheck %s

// A transformer MLP's bias + GELU and a layer norm: the matmul stays (a BLAS call), the
// broadcast is read inside the kernel, add + gelu become one kernel with both values as
// results (the add is returned too), the layer norm becomes a row kernel. The body keeps
// the replaced ops; the source is CUDA C.

builtin.module {
  func.func @mlp(%x: tensor<4x8xf32>, %w: tensor<8x16xf32>, %b: tensor<16xf32>, %g: tensor<16xf32>, %c: tensor<16xf32>) -> (tensor<4x16xf32>, tensor<4x16xf32>) {
    %h = graph.matmul %x, %w : (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
    %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<16xf32>) -> tensor<4x16xf32>
    %s = graph.add %h, %bb : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
    %y = graph.gelu %s {approximate = "tanh"} : (tensor<4x16xf32>) -> tensor<4x16xf32>
    %n = graph.layer_norm %y, %g, %c {eps = 1.000000e-05 : f64} : (tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>) -> tensor<4x16xf32>
    func.return %s, %n : tensor<4x16xf32>, tensor<4x16xf32>
  }
}

// CHECK-LABEL: func.func @mlp
// CHECK-NEXT:    [[H:%.*]] = graph.matmul %x, %w
// CHECK-NEXT:    [[S:%.*]], [[Y:%.*]] = "kernel.fused"([[H]], %b) <{kernel = "k1_add_gelu", dtype = "f32", source = "{{.*}}HS_KERNEL void k1_add_gelu({{.*}}", launches = ["row k1_add_gelu 4 16"], scratch = array<i64>}> ({
// CHECK-NEXT:    ^{{.*}}([[A:%.*]]: tensor<4x16xf32>, [[B:%.*]]: tensor<16xf32>):
// CHECK-NEXT:      [[BB:%.*]] = graph.broadcast [[B]] {dims = array<i64: 1>}
// CHECK-NEXT:      [[S2:%.*]] = graph.add [[A]], [[BB]]
// CHECK-NEXT:      [[Y2:%.*]] = graph.gelu [[S2]] {approximate = "tanh"}
// CHECK-NEXT:      "kernel.yield"([[S2]], [[Y2]])
// CHECK-NEXT:    }) : (tensor<4x16xf32>, tensor<16xf32>) -> (tensor<4x16xf32>, tensor<4x16xf32>)
// CHECK-NEXT:    [[N:%.*]] = "kernel.fused"([[Y]], %g, %c) <{kernel = "k0_layer_norm", dtype = "f32", source = "{{.*}}hs_block_sum{{.*}}", launches = ["row k0_layer_norm 4 16"], scratch = array<i64>}> ({
// CHECK:           graph.layer_norm
// CHECK:         func.return [[S]], [[N]] : tensor<4x16xf32>, tensor<4x16xf32>
