// RUN: hspmd-opt %s -p 'clip-grad-norm{max_norm=2.0}' | filecheck %s
// RUN: hspmd-opt %s -p 'clip-grad-norm{max_norm=2.0},sgd{lr=0.5}' | filecheck %s --check-prefix=SGD

// The squared norms of all gradients are summed (in f64) into one clip factor
// min(1, max_norm / (sqrt(total) + 1e-6)); each "grad:NAME" output now outputs its gradient
// times that factor, at the end of the step, where an optimizer pass picks it up.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32>
    %l = graph.constant {value = 0.0 : f64} : tensor<f32>
    graph.output "loss", %l : tensor<f32>
    %gw = graph.constant {value = 1.0 : f64} : tensor<4x3xf32>
    graph.output "grad:w", %gw : tensor<4x3xf32>
    %gb = graph.constant {value = 2.0 : f64} : tensor<3xf32>
    graph.output "grad:b", %gb : tensor<3xf32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         %gw = graph.constant
// CHECK-NEXT:    %gb = graph.constant
// CHECK-NEXT:    [[SW:%.*]] = optim.sum_squares %gw : (tensor<4x3xf32>) -> tensor<f64>
// CHECK-NEXT:    [[SB:%.*]] = optim.sum_squares %gb : (tensor<3xf32>) -> tensor<f64>
// CHECK-NEXT:    [[T:%.*]] = graph.add [[SW]], [[SB]] : (tensor<f64>, tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    [[C:%.*]] = optim.clip_coef [[T]] {max_norm = 2.000000e+00 : f64} : (tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    [[CW:%.*]] = optim.mul_scalar %gw, [[C]] : (tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
// CHECK-NEXT:    graph.output "grad:w", [[CW]] : tensor<4x3xf32>
// CHECK-NEXT:    [[CB:%.*]] = optim.mul_scalar %gb, [[C]] : (tensor<3xf32>, tensor<f64>) -> tensor<3xf32>
// CHECK-NEXT:    graph.output "grad:b", [[CB]] : tensor<3xf32>
// CHECK-NEXT:    func.return

// SGD:         [[CW:%.*]] = optim.mul_scalar %gw
// SGD:         [[CB:%.*]] = optim.mul_scalar %gb
// SGD-NOT:     graph.output "grad:
// SGD:         optim.sgd %w, [[CW]],
// SGD:         optim.sgd %b, [[CB]],
