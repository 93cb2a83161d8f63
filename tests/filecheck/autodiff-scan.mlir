// RUN: hspmd-opt %s -p autodiff | filecheck %s

// A scan is differentiated as a reverse scan of the layer's backward: the forward scan calls
// @Layer_0_fwd, which returns the stacked residuals it computes (the layer's input x, carried,
// comes out stacked) but not its weight, which the backward reads from the forward's stacked
// operand; the backward scan carries the gradient of the stream from the last layer to the
// first and returns the stacked weight's gradient, one slice per layer.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "l.[0:3].w" {init = "normal:0.02"} : tensor<3x4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h = graph.scan @Layer_0(%w, %x) {length = 3 : i64, stacked = array<i64: 0>, carry_args = array<i64: 1>, carry_results = array<i64: 0>} : (tensor<3x4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %h {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @Layer_0(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    func.return %y : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         [[H:%.*]], [[XS:%.*]] = graph.scan @Layer_0_fwd(%w, %x) {length = 3 : i64, stacked = array<i64: 0>, carry_args = array<i64: 1>, carry_results = array<i64: 0>} : (tensor<3x4x4xf32>, tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<3x2x4xf32>)
// CHECK:         [[DW:%.*]], [[DX:%.*]] = graph.scan @Layer_0_bwd({{%.*}}, %w, [[XS]]) {length = 3 : i64, stacked = array<i64: 1, 2>, carry_args = array<i64: 0>, carry_results = array<i64: 1>, reverse} : (tensor<2x4xf32>, tensor<3x4x4xf32>, tensor<3x2x4xf32>) -> (tensor<3x4x4xf32>, tensor<2x4xf32>)
// CHECK:         graph.output "grad:l.[0:3].w", [[DW]] : tensor<3x4x4xf32>
// CHECK:       func.func private @Layer_0_bwd
// CHECK:       func.func private @Layer_0_fwd(%{{.*}}: tensor<4x4xf32>, %{{.*}}: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>)
// CHECK:         func.return %y, %x
// CHECK-NOT:   func.func private @Layer_0(
