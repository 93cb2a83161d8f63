// RUN: hspmd-opt %s -p cut-stacked-layers | filecheck %s

// A pipeline of 2 stages over 4 stacked layers (the physical step before assign-pipeline-stages):
// the layers balance 2:2, so the stacked weight becomes "layers.[0:2]" and "layers.[2:4]", the
// forward scan two scans of 2 layers (marked with their stage, chained through the carry), the
// backward scan two reverse scans (the last layers' first), the update one op per piece.

builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0,1]: dp=1 pp=2", microbatches = 1, schedule = "gpipe">]} {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">} {
    func.func @train_step() {
      %0 = graph.parameter "layers.[0:4].fc.weight" {init = "uniform:-0.5:0.5", global_type = tensor<4x4x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<4x4x4xf32>
      %1 = graph.input "x" {global_type = tensor<2x4xf32, #dist.layout<"[0]: dup=1">>} : tensor<2x4xf32>
      %2, %3, %4 = graph.scan @Layer_0_fwd(%0, %1) {length = 4 : i64, stacked = array<i64: 0>, carry_args = array<i64: 1>, carry_results = array<i64: 0>} : (tensor<4x4x4xf32>, tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<4x2x4xf32>, tensor<4x2x4xf32>)
      %5 = graph.reduce_sum %2 {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
      graph.output "loss", %5 : tensor<f32>
      %6 = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
      %7 = graph.broadcast %6 {dims = array<i64>} : (tensor<f32>) -> tensor<2x4xf32>
      %8, %9 = graph.scan @Layer_0_bwd(%7, %3, %0, %4) {length = 4 : i64, stacked = array<i64: 1, 2, 3>, carry_args = array<i64: 0>, carry_results = array<i64: 1>, reverse} : (tensor<2x4xf32>, tensor<4x2x4xf32>, tensor<4x4x4xf32>, tensor<4x2x4xf32>) -> (tensor<4x4x4xf32>, tensor<2x4xf32>)
      %10 = graph.constant {value = 1.000000e-01 : f64} : tensor<f64>
      %11 = graph.parameter "opt.step" {init = "zeros", global_type = tensor<i64, #dist.layout<"[0]: dup=1">>} : tensor<i64>
      %12 = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
      %13 = graph.add %11, %12 : (tensor<i64>, tensor<i64>) -> tensor<i64>
      graph.assign "opt.step", %13 : tensor<i64>
      %14 = optim.sgd %0, %8, %10 {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x4x4xf32>, tensor<4x4x4xf32>, tensor<f64>) -> tensor<4x4x4xf32>
      graph.assign "layers.[0:4].fc.weight", %14 : tensor<4x4x4xf32>
      func.return
    }
    func.func private @Layer_0_bwd(%0: tensor<2x4xf32>, %1: tensor<2x4xf32>, %2: tensor<4x4xf32>, %3: tensor<2x4xf32>) -> (tensor<4x4xf32>, tensor<2x4xf32>) {
      %4 = graph.relu_grad %1, %0 : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
      %5 = graph.transpose %2 {perm = array<i64: 1, 0>} : (tensor<4x4xf32>) -> tensor<4x4xf32>
      %6 = graph.matmul %4, %5 : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
      %7 = graph.transpose %3 {perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
      %8 = graph.matmul %7, %4 : (tensor<4x2xf32>, tensor<2x4xf32>) -> tensor<4x4xf32>
      func.return %8, %6 : tensor<4x4xf32>, tensor<2x4xf32>
    }
    func.func private @Layer_0_fwd(%0: tensor<4x4xf32>, %1: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>) {
      %2 = graph.matmul %1, %0 : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
      %3 = graph.relu %2 : (tensor<2x4xf32>) -> tensor<2x4xf32>
      func.return %3, %2, %1 : tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>
    }
  }
}

// CHECK:      [[W0:%.*]] = graph.parameter "layers.[0:2].fc.weight" {{.*}} : tensor<2x4x4xf32>
// CHECK-NEXT: [[W1:%.*]] = graph.parameter "layers.[2:4].fc.weight" {{.*}} : tensor<2x4x4xf32>
// CHECK-NEXT: [[X:%.*]] = graph.input "x"
// CHECK-NEXT: [[H0:%.*]], [[A0:%.*]], [[B0:%.*]] = graph.scan @Layer_0_fwd([[W0]], [[X]]) {pipeline.layer_stage = 0 : i64, length = 2 : i64
// CHECK-NEXT: [[H1:%.*]], [[A1:%.*]], [[B1:%.*]] = graph.scan @Layer_0_fwd([[W1]], [[H0]]) {pipeline.layer_stage = 1 : i64, length = 2 : i64
// CHECK-NEXT: graph.reduce_sum [[H1]]
// CHECK:      [[G1:%.*]], [[D1:%.*]] = graph.scan @Layer_0_bwd({{%.*}}, [[A1]], [[W1]], [[B1]]) {length = 2 : i64, {{.*}} reverse}
// CHECK-NEXT: [[G0:%.*]], [[D0:%.*]] = graph.scan @Layer_0_bwd([[D1]], [[A0]], [[W0]], [[B0]]) {length = 2 : i64, {{.*}} reverse}
// CHECK:      [[U0:%.*]] = optim.sgd [[W0]], [[G0]]
// CHECK-NEXT: [[U1:%.*]] = optim.sgd [[W1]], [[G1]]
// CHECK-NEXT: graph.assign "layers.[0:2].fc.weight", [[U0]]
// CHECK-NEXT: graph.assign "layers.[2:4].fc.weight", [[U1]]
// CHECK-NOT:  "layers.[0:4]
