// RUN: hspmd-opt %s -p 'sgd{lr=0.25}' | filecheck %s
// RUN: hspmd-opt %s -p 'sgd{lr=0.25 momentum=0.9 weight_decay=0.01 nesterov=true}' | filecheck %s --check-prefix=MOM
// RUN: hspmd-opt %s -p 'sgd{lr_input=true}' | filecheck %s --check-prefix=INPUT

// Each "grad:NAME" output becomes one optim.sgd of the parameter, its gradient and the
// learning rate, and graph.assign "NAME" of the result; the gradient outputs are gone,
// other outputs stay; opt.step counts steps. With a momentum, each parameter gets a
// zero-initialised buffer "opt.momentum.NAME" that the update reads and writes back.
// With lr_input=true the learning rate is the scalar input "lr" (fed per step).

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
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NOT:     graph.output "grad:
// CHECK:         [[LR:%.*]] = graph.constant {value = 2.500000e-01 : f64} : tensor<f64>
// CHECK-NEXT:    [[STEP:%.*]] = graph.parameter "opt.step" {init = "zeros"} : tensor<i64>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
// CHECK-NEXT:    [[STEP1:%.*]] = graph.add [[STEP]], [[ONE]] : (tensor<i64>, tensor<i64>) -> tensor<i64>
// CHECK-NEXT:    graph.assign "opt.step", [[STEP1]] : tensor<i64>
// CHECK-NEXT:    [[NW:%.*]] = optim.sgd %w, %gw, [[LR]] {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> tensor<4x3xf32>
// CHECK-NEXT:    graph.assign "w", [[NW]] : tensor<4x3xf32>
// CHECK-NEXT:    [[NB:%.*]] = optim.sgd %b, %gb, [[LR]] {{.*}} : (tensor<3xf32>, tensor<3xf32>, tensor<f64>) -> tensor<3xf32>
// CHECK-NEXT:    graph.assign "b", [[NB]] : tensor<3xf32>
// CHECK-NEXT:    func.return
// CHECK-NOT:     graph.output "grad:

// MOM:         [[LR:%.*]] = graph.constant {value = 2.500000e-01 : f64} : tensor<f64>
// MOM:         [[BUF:%.*]] = graph.parameter "opt.momentum.w" {init = "zeros"} : tensor<4x3xf32>
// MOM-NEXT:    [[NW:%.*]], [[NBUF:%.*]] = optim.sgd %w, %gw, [[BUF]], [[LR]] {momentum = 9.000000e-01 : f64, weight_decay = 1.000000e-02 : f64, nesterov = true} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>) -> (tensor<4x3xf32>, tensor<4x3xf32>)
// MOM-NEXT:    graph.assign "w", [[NW]] : tensor<4x3xf32>
// MOM-NEXT:    graph.assign "opt.momentum.w", [[NBUF]] : tensor<4x3xf32>
// MOM-NEXT:    [[BUFB:%.*]] = graph.parameter "opt.momentum.b" {init = "zeros"} : tensor<3xf32>
// MOM-NEXT:    [[NB:%.*]], [[NBUFB:%.*]] = optim.sgd %b, %gb, [[BUFB]], [[LR]]
// MOM-NEXT:    graph.assign "b", [[NB]] : tensor<3xf32>
// MOM-NEXT:    graph.assign "opt.momentum.b", [[NBUFB]] : tensor<3xf32>
// MOM-NEXT:    func.return

// INPUT:       [[LR:%.*]] = graph.input "lr" : tensor<f64>
// INPUT:       optim.sgd %w, %gw, [[LR]] {momentum = 0.000000e+00 : f64, weight_decay = 0.000000e+00 : f64, nesterov = false}
// INPUT:       optim.sgd %b, %gb, [[LR]]
